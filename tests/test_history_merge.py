"""``history --merge DIR...`` (``conformance/commands/history_merge.py``) on hand-built shard
reports that disagree (``tests/data/shards``): a cell red on one shard and green on another
stays red and is listed as a disagreement; a cell red on one shard and absent on the other
stays red; each FAIL links its replay (copied under --out) and its known bug's folder (written
under --out); the known bugs hit are listed once each with their bracket and every row they
explained, however many shards hit them; the FAILs new since the previous night; the programs' FAILs no known bug explains are leads, kept in
--leads-dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.commands import history_merge
from conformance.commands.history import Row
from conformance.errors import KitError

ROOT = Path(__file__).resolve().parents[1]
SHARDS = ROOT / "tests" / "data" / "shards"
PROGRAMS_CELL = "qwen3-next-80b-extra_buffer-p64-t256-eviction-tlru"
KL_CELL = "nemotron-nano-9b-v2-extra_buffer-p1-t256-path_cap-1"
GDN = "gdn-page-above-chunk-track-state-misindexed"


@pytest.fixture
def shards(tmp_path) -> tuple[Path, Path]:
    for name in ("a", "b"):
        shutil.copytree(SHARDS / name, tmp_path / name)
    return tmp_path / "a", tmp_path / "b"


def rows_of(doc) -> dict[tuple[str, str, str], Row]:
    return {(r["release"], r["check"], r["cell"]): Row(**r) for r in doc["rows"]}


def test_shards_that_disagree_keep_the_fail_and_say_so(shards, tmp_path):
    doc = history_merge.merge(list(shards), tmp_path / "out")
    rows = rows_of(doc)
    kl = rows[("0.5.16", "sglang-cpu:kl", KL_CELL)]
    assert kl.status == "fail" and kl.known_bug == "gdn-page-above-chunk-track-state-misindexed"
    assert doc["disagreements"] == [{"release": "0.5.16", "check": "sglang-cpu:kl", "cell": KL_CELL,
                                     "statuses": {str(shards[0]): "fail", str(shards[1]): "pass"}}]
    # red on shard a, absent on shard b: still red; green on 0.5.22 (shard b only): green
    assert rows[("0.5.16", "sglang-cpu:programs", PROGRAMS_CELL)].status == "fail"
    assert rows[("0.5.22", "sglang-cpu:programs", PROGRAMS_CELL)].status == "pass"
    assert len([k for k in rows if k[:2] == ("0.5.16", "install")]) == 1
    assert [s["index"] for s in doc["shards"]] == [1, 2] and doc["probes"].keys() == {"0.5.16", "0.5.22"}


def test_the_merge_check_is_not_vacuous_shards_that_agree_have_no_disagreement(shards, tmp_path):
    doc = history_merge.merge([shards[0]], tmp_path / "out")
    assert doc["disagreements"] == [] and ("0.5.22", "sglang-cpu:programs", PROGRAMS_CELL) not in rows_of(doc)


def test_each_fail_links_its_replay_and_known_bug_in_the_page(shards, tmp_path):
    out = tmp_path / "out"
    doc = history_merge.merge(list(shards), out)
    replay = rows_of(doc)[("0.5.16", "sglang-cpu:programs", PROGRAMS_CELL)].replay
    assert Path(replay) == out / "replays" / "0.5.16" / "programs-p64-tlru.json" and Path(replay).is_file()
    page = (out / "history.html").read_text()
    assert 'href="replays/0.5.16/programs-p64-tlru.json"' in page
    assert f'href="bugs/{GDN}/README.md">known bug {GDN}' in page and (out / "bugs" / GDN / "README.md").is_file()
    assert (out / "known-bugs.md").is_file()
    assert "releases x checks x cells" in page and KL_CELL in page and "shards that disagree" in page
    assert json.loads((out / "history.json").read_text())["rows"] == doc["rows"]


def test_the_known_bugs_hit_are_listed_once_with_their_bracket_rows_and_written_folder(shards, tmp_path):
    b = json.loads((shards[1] / "history.json").read_text())
    b["rows"].append({"release": "0.5.16", "check": "sglang-cpu:programs", "status": "fail", "cell": KL_CELL, "replay": "", "known_bug": "",
                      "reason": f"known SGLang bug, still present ({GDN}): hit 0 where the oracle allows 64"})
    (shards[1] / "history.json").write_text(json.dumps(b))
    out = tmp_path / "out"
    doc = history_merge.merge(list(shards), out)
    [bug] = doc["known_bugs"]
    assert bug["id"] == GDN and (bug["first_bad"], bug["first_good"]) == ("0.5.13", "0.5.19") and bug["folder"] == f"bugs/{GDN}/README.md"
    assert bug["where"] == [{"release": "0.5.16", "check": "sglang-cpu:kl", "cell": KL_CELL},
                            {"release": "0.5.16", "check": "sglang-cpu:programs", "cell": KL_CELL}]
    page = (out / "history.html").read_text()
    section = page[page.index("<h2>known SGLang bugs hit</h2>"):]
    section = section[:section.index("</ul>")]
    assert section.count(f'<a href="bugs/{GDN}/README.md">') == 1 and "first bad 0.5.13, first good 0.5.19" in section
    assert "explained 2 FAIL row(s): 0.5.16 sglang-cpu:kl [" in section and "0.5.16 sglang-cpu:programs [" in section
    assert (out / bug["folder"]).is_file() and json.loads((out / "history.json").read_text())["known_bugs"] == [bug]


def test_a_merge_without_a_known_bug_fail_lists_none_and_writes_no_folder(tmp_path):
    doc = {"rows": [{"release": "0.5.12", "check": "pool:session_reuse", "status": "fail", "reason": "leak"}], "probes": {}}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "history.json").write_text(json.dumps(doc))
    merged = history_merge.merge([tmp_path / "a"], tmp_path / "out")
    assert merged["known_bugs"] == [] and not (tmp_path / "out" / "bugs").exists()
    assert "<h2>known SGLang bugs hit</h2><ul><li>none</li></ul>" in (tmp_path / "out" / "history.html").read_text()


def test_new_since_the_last_night_and_none_without_one(shards, tmp_path):
    previous = json.loads((SHARDS / "previous.json").read_text())
    doc = history_merge.merge(list(shards), tmp_path / "out", previous=previous)
    assert [(n["release"], n["check"], n["cell"]) for n in doc["new_since_last_night"]] == [("0.5.16", "sglang-cpu:programs", PROGRAMS_CELL)]
    assert history_merge.merge(list(shards), tmp_path / "o2")["new_since_last_night"] is None
    assert "no previous night" in (tmp_path / "o2" / "history.html").read_text()


def test_programs_fails_no_known_bug_explains_are_leads_kept_as_replays(shards, tmp_path):
    leads = tmp_path / "leads"
    doc = history_merge.merge(list(shards), tmp_path / "out", leads_dir=leads)
    [lead] = doc["leads"]
    assert lead["cell"] == PROGRAMS_CELL and lead["release"] == "0.5.16"
    assert Path(lead["kept"]) == leads / f"{PROGRAMS_CELL}-0.5.16.json" and Path(lead["kept"]).is_file()
    assert doc["open_leads"] == [f"{PROGRAMS_CELL}-0.5.16.json"]
    assert "leads (programs" in (tmp_path / "out" / "history.html").read_text()


def test_a_folder_without_history_json_is_one_line(tmp_path):
    with pytest.raises(KitError, match="is not a history.json"):
        history_merge.merge([tmp_path], tmp_path / "out")


def test_merge_through_the_console_script_exits_1_on_a_fail(shards, tmp_path):
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "history", "--merge", *map(str, shards), "--previous",
                          str(SHARDS / "previous.json"), "--out", str(tmp_path / "merged")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "2 shards" in out.stdout and "1 disagreements" in out.stdout and "new since the last night: 1" in out.stdout
    assert f"known SGLang bug {GDN} (releases >=0.5.13,<0.5.19: first bad 0.5.13, first good 0.5.19): 1 FAIL row(s); bug folder: " in out.stdout
    assert (tmp_path / "merged" / "history.html").is_file()


def test_the_cells_a_night_left_out_reach_the_merged_document_and_page_once(shards, tmp_path):
    """Each shard's history.json names the cells its plan left out (no suite of the night
    binds them); the merge lists each once, in history.json and on the page; shards that
    name none give none."""
    out = {"cell": "qwen3-next-80b-no_buffer-p1-t256-disagg_transfer_fail", "why": "no suite of the night binds it (its suites: disagg)"}
    assert history_merge.merge(list(shards), tmp_path / "before")["left_out"] == []
    for folder in shards:
        doc = json.loads((folder / "history.json").read_text())
        doc["shard"]["left_out"] = [out]
        (folder / "history.json").write_text(json.dumps(doc))
    merged = history_merge.merge(list(shards), tmp_path / "out")
    assert merged["left_out"] == [out]
    page = (tmp_path / "out" / "history.html").read_text()
    assert "cells the night left out" in page and page.count(out["cell"]) == 1


def test_a_fail_no_known_bug_marked_when_its_shard_ran_is_judged_again_against_todays_entries(tmp_path):
    """A shard ran before the entry that explains its FAIL existed: the merge reads the
    verdict in the shard's run report and marks the row with today's entry when every
    finding is excused (kind, cell, release and facts as a run of today would judge it);
    a finding of another kind, or a release outside the entry's range, stays unexplained."""
    cell = "qwen3-next-80b-extra_buffer-p1-t256-mixed_chunk-on"
    hit = {"kind": "answer_differs_on_hit", "line": "top-k KL 0.313 > limit 1e-09 on sequence 3 (prefill_hit, start 585, cached 576)",
           "facts": {"sequence": 3, "scenario": "prefill_hit", "start": 585, "cached_tokens": 576}}
    miss = {**hit, "kind": "answer_differs_on_miss"}

    def shard(name, release, findings):
        folder = tmp_path / name
        run = folder / "runs" / f"{release}-shard-1"
        run.mkdir(parents=True)
        verdict = {"status": "fail", "reason": hit["line"], "details": {"findings": findings}}
        (run / "report.json").write_text(json.dumps({"cells": [{"id": cell, "checks": {"kl": verdict}}]}))
        row = {"release": release, "check": "sglang-cpu:kl", "status": "fail", "reason": hit["line"], "cell": cell, "replay": "", "known_bug": ""}
        (folder / "history.json").write_text(json.dumps({"rows": [row], "probes": {}, "shard": {"index": 1, "of": "1"}}))
        return folder

    judged = rows_of(history_merge.merge([shard("a", "0.5.18", [hit])], tmp_path / "out-a"))
    assert judged[("0.5.18", "sglang-cpu:kl", cell)].known_bug == "mixed-chunk-prefill-track-dropped-kl"
    for name, release, findings in (("b", "0.5.18", [hit, miss]), ("c", "0.5.23", [hit])):
        rows = rows_of(history_merge.merge([shard(name, release, findings)], tmp_path / f"out-{name}"))
        assert rows[(release, "sglang-cpu:kl", cell)].known_bug == "", name


def _with_kit(folder: Path, commit: str, time: int) -> None:
    doc = json.loads((folder / "history.json").read_text())
    doc["shard"] = {**(doc.get("shard") or {}), "kit": {"commit": commit, "time": time, "modified": False}}
    (folder / "history.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("newer", [0, 1])
def test_a_newer_kits_row_replaces_an_older_kits_and_is_listed_as_superseded(shards, tmp_path, newer):
    """Shards run by different kits: the newer kit's row of a key stands (red or green), the
    older one is listed under ``superseded`` with both kits, and they are no disagreement;
    shards of one kit still disagree (the test above)."""
    _with_kit(shards[newer], "b" * 40, 2_000)
    _with_kit(shards[1 - newer], "a" * 40, 1_000)
    doc = history_merge.merge(list(shards), tmp_path / "out")
    kl = rows_of(doc)[("0.5.16", "sglang-cpu:kl", KL_CELL)]
    assert kl.status == ("fail", "pass")[newer] and doc["disagreements"] == []
    assert [(s["cell"], s["status"], s["folder"], s["kit"], s["by"]) for s in doc["superseded"] if s["check"] == "sglang-cpu:kl"] == [
        (KL_CELL, ("pass", "fail")[newer], str(shards[1 - newer]), "a" * 12, "b" * 12)]
    assert "rows a newer kit ran again" in (tmp_path / "out" / "history.html").read_text()
    both = {(r["release"], r["check"]) for r in json.loads((shards[0] / "history.json").read_text())["rows"] if not r["cell"]} & \
           {(r["release"], r["check"]) for r in json.loads((shards[1] / "history.json").read_text())["rows"] if not r["cell"]}
    assert both and not [x for x in doc["superseded"] if (x["release"], x["check"]) in both]  # rows both kits agree on: not listed


def test_kit_identity_names_this_checkout_and_nothing_outside_one(tmp_path):
    from conformance.commands.kit_identity import kit_identity, kit_of
    me = kit_identity()
    assert len(me["commit"]) == 40 and me["time"] > 1_700_000_000
    assert kit_identity(tmp_path) == {"commit": "", "time": 0, "modified": False}
    assert kit_of({"kit": me}) == (me["time"], me["commit"]) and kit_of(None) == (0, "")


def test_a_newer_kits_run_of_a_unit_supersedes_the_older_kits_rows_of_other_checks(tmp_path):
    """A release x cell unit the newer kit ran again replaces every row the older kit filed for
    it, also one under a check the newer run has no row for (an older start-up error filed
    under ``test`` that the newer run passed under ``programs``); another cell's row of the
    older kit stays, and release-level rows are still compared key by key."""
    def shard(name: str, commit: str, time: int, rows: list[tuple[str, str, str]]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        doc = {"rows": [{"release": "0.5.17", "check": c, "status": st, "reason": "r" if st == "fail" else "", "cell": cell,
                         "replay": "", "known_bug": ""} for c, cell, st in rows],
               "probes": {}, "shard": {"index": 1, "of": "1", "kit": {"commit": commit, "time": time, "modified": False}}}
        (folder / "history.json").write_text(json.dumps(doc))
        return folder

    old = shard("old", "a" * 40, 1_000, [("sglang-cpu:test", KL_CELL, "fail"), ("sglang-cpu:kl", PROGRAMS_CELL, "fail"), ("pool", "", "fail")])
    new = shard("new", "b" * 40, 2_000, [("sglang-cpu:programs", KL_CELL, "pass"), ("sglang-cpu:kl", KL_CELL, "pass")])
    doc = history_merge.merge([old, new], tmp_path / "out")
    rows = rows_of(doc)
    assert ("0.5.17", "sglang-cpu:test", KL_CELL) not in rows and rows[("0.5.17", "sglang-cpu:programs", KL_CELL)].status == "pass"
    assert rows[("0.5.17", "sglang-cpu:kl", PROGRAMS_CELL)].status == "fail" and rows[("0.5.17", "pool", "")].status == "fail"
    assert [(s["check"], s["cell"], s["status"], s["by"]) for s in doc["superseded"]] == [("sglang-cpu:test", KL_CELL, "fail", "b" * 12)]
