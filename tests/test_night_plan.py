"""``plan --releases A..B --shards N`` and ``history --shard K/N``
(``conformance/commands/night_plan.py``): every release sees every axis value each night,
every pair of axis values is covered on some release, seven nights run the full release x
cell product, no shard is longer than the limit, and the costs come from the repository's
file (measured cells replace the defaults); a fill plans only what a merged history lacks."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.commands import history, night_plan
from conformance.commands.night_plan import Costs, Fill, axis_values, plan_night
from conformance.errors import KitError
from conformance.matrix.cells import load_matrix

ROOT = Path(__file__).resolve().parents[1]
RELEASES = night_plan.parse_release_range("0.5.11..0.5.23")
NIGHT = datetime.date(2026, 11, 28)


def nightly_cells():
    return load_matrix().select(target="sglang-cpu", tier="nightly")


def plan(night=NIGHT, releases=RELEASES, cells=None, **kw):
    kw.setdefault("budget", None)
    return plan_night(releases, nightly_cells() if cells is None else cells, Costs.load(), night=night, tier="nightly",
                      suites=history.CPU_SUITES, **kw)


def test_release_range_expands_and_a_bad_one_is_one_line():
    assert RELEASES == [f"0.5.{p}" for p in range(11, 24)]
    assert history.parse_releases("0.5.11..0.5.13,0.5.22") == ["0.5.11", "0.5.12", "0.5.13", "0.5.22"]
    for bad in ("0.5.13..0.5.11", "0.5.11..0.6.2", "x..0.5.13"):
        with pytest.raises(KitError, match="not a range of one minor series"):
            night_plan.parse_release_range(bad)


def test_every_release_sees_every_axis_value_and_every_pair_is_covered():
    p = plan()
    cov = p.coverage()
    assert cov["releases_missing_values"] == {} and cov["pairs_covered"] == cov["pairs"] > 500, cov
    values = set().union(*(axis_values(c) for c in p.cells))
    for r in RELEASES:
        seen = set().union(*(axis_values(u.cell) for u in p.units if u.release == r))
        assert seen == values, r
    assert {u.why for u in p.units} >= {"slice", "axis"}


def test_every_standard_cell_runs_on_three_releases_each_night():
    """Rule 4: each standard-tier cell on at least three releases, the newest that lack it;
    a plan without those units (seeded: the spread units dropped) is reported short."""
    p = plan()
    standard = {c.id for c in p.cells if c.tier in ("premerge", "standard")}
    assert standard and p.coverage()["spread_cells_short"] == [] and p.coverage()["spread_cells"] == len(standard)
    for c in standard:
        assert len({u.release for u in p.units if u.cell.id == c}) >= 3, c
    spread = [u for u in p.units if u.why == "spread"]
    assert spread and all(u.cell.id in standard for u in spread)
    for c in {u.cell.id for u in spread}:  # the newest first: every release above its oldest spread unit runs the cell
        oldest = min(RELEASES.index(u.release) for u in spread if u.cell.id == c)
        assert all(any(u.cell.id == c and u.release == r for u in p.units) for r in RELEASES[oldest:]), c
    seeded = night_plan.NightPlan(**{**p.__dict__, "units": tuple(u for u in p.units if u.why != "spread")})
    assert seeded.coverage()["spread_cells_short"] == sorted({u.cell.id for u in spread})
    n = len(standard)
    assert f"{n} of {n} standard cells on at least 3 releases" in p.render()
    assert f"{n - len(seeded.coverage()['spread_cells_short'])} of {n} standard cells" in seeded.render()


def test_the_coverage_check_is_not_vacuous():
    """A plan whose units miss a value on a release (seeded: that release's units dropped
    but one) is reported missing values there, and uncovered pairs count as uncovered."""
    p = plan()
    one = next(u for u in p.units if u.release == "0.5.16")
    seeded = night_plan.NightPlan(**{**p.__dict__, "units": tuple(u for u in p.units if u.release != "0.5.16") + (one,)})
    assert "0.5.16" in seeded.coverage()["releases_missing_values"]
    bare = night_plan.NightPlan(**{**p.__dict__, "units": (one,)})
    assert bare.coverage()["pairs_covered"] < bare.coverage()["pairs"]


def test_seven_nights_run_the_whole_product_once_each_and_nights_differ():
    product = {(r, c.id) for r in RELEASES for c in plan().cells}  # the cells the night's suites bind
    slices = []
    for d in range(7):
        p = plan(night=NIGHT + datetime.timedelta(days=d))
        slices.append({(u.release, u.cell.id) for u in p.units if u.why == "slice"})
    assert set().union(*slices) == product
    assert all(not (a & b) for a, b in itertools.combinations(slices, 2))
    assert plan(night=NIGHT).units == plan(night=NIGHT).units  # deterministic
    assert plan(night=NIGHT).units != plan(night=NIGHT + datetime.timedelta(days=1)).units


def test_shards_stay_under_the_limit_and_hold_each_unit_once():
    p = plan()
    assert all(s.seconds <= p.limit_s for s in p.shards)
    held = [(part.release, c) for s in p.shards for part in s.parts for c in part.cells]
    assert sorted(held) == sorted((u.release, u.cell.id) for u in p.units)
    first = [part.release for s in p.shards for part in s.parts if part.checks]
    assert sorted(first) == sorted(RELEASES)  # each release's once-a-night checks on exactly one shard


def test_shards_n_is_exact_or_one_line_when_too_few():
    p = plan()
    wider = plan(shards=len(p.shards) + 3)
    assert len(wider.shards) == len(p.shards) + 3 and max(s.seconds for s in wider.shards) <= p.limit_s
    with pytest.raises(KitError, match=rf"--shards 2: tonight needs {len(p.shards)} shards of at most 20 min"):
        plan(shards=2)
    with pytest.raises(KitError, match="tonight's plan has"):
        p.shard(f"1/{len(p.shards) + 1}")
    with pytest.raises(KitError, match="expected K/N"):
        p.shard("0/3")
    assert p.shard(f"2/{len(p.shards)}") is p.shards[1]


def test_costs_measured_cells_replace_the_defaults_and_pages_cost_more_before_0523(tmp_path):
    costs = Costs.load()
    cells = {c.id: c for c in nightly_cells()}
    base = next(c for c in cells.values() if c.id not in costs.cells and c.page_size == 1)  # left to the defaults
    paged = cells["qwen3-next-80b-extra_buffer-p64-t256"]
    suites = ("kl", "programs")
    assert costs.cell_seconds(paged, "0.5.16", suites=suites, budget="ci") > costs.cell_seconds(paged, "0.5.23", suites=suites, budget="ci")
    assert costs.programs_seconds("90s") == 90 + costs.programs["overhead"]
    assert costs.programs_seconds("nightly") > costs.programs_seconds("standard") > costs.programs_seconds("ci")
    text = (ROOT / "fixtures" / "cell_costs.toml").read_text() + f'\n[cells."{base.id}"]\nkl = 500.0\n'
    (tmp_path / "c.toml").write_text(text)
    measured = Costs.load(tmp_path / "c.toml")
    assert measured.cell_seconds(base, "0.5.23", suites=suites, budget="ci") - costs.cell_seconds(base, "0.5.23", suites=suites, budget="ci") \
        == pytest.approx(500.0 - costs.suites["kl"] - costs.server_start - costs.idle)  # its junit times hold its server's start
    (tmp_path / "bad.toml").write_text("schema = 1\n")
    with pytest.raises(KitError, match="not a cell-costs file"):
        Costs.load(tmp_path / "bad.toml")


def test_measured_costs_read_junit_and_print_the_costs_tables(tmp_path):
    suite = ET.Element("testsuite")
    for cls, name, t in [("conformance.suites.kl.test_kl", "test_kl[a-b]@cell-1", "3.5"), ("conformance.suites.kl.test_kl", "test_kl2[x]@cell-1", "1.0"),
                         ("conformance.suites.programs.test_programs", "test_programs[cell-1]@cell-1", "171.4"), ("tests.test_x", "test_y@cell-1", "9")]:
        ET.SubElement(suite, "testcase", classname=cls, name=name, time=t)
    ET.ElementTree(suite).write(tmp_path / "junit.xml")
    measured = night_plan.measured_costs([tmp_path, tmp_path / "missing"])
    assert measured == {"cell-1": {"kl": 4.5, "programs": pytest.approx(171.4)}}
    assert night_plan.costs_toml(measured) == '[cells."cell-1"]\nkl = 4.5\nprograms = 171.4'
    assert night_plan.costs_toml({"dead": {"kl": 0.1, "leaks": 0.1}}) == ""  # its server never started: the defaults stay


def test_measured_costs_leave_out_a_cell_whose_server_failed_on_setup(tmp_path):
    """Seeded: a cell whose first test timed a 597 s failed start (setup error) is not measured;
    not vacuous: a cell whose check failed after its server served keeps its times."""
    suite = ET.Element("testsuite")
    for name, t, error in [("test_agreement[x]@refused", "597.6", 'failed on setup with "Failed: sglang-cpu server for refused'),
                           ("test_kl[x]@refused", "0.1", 'failed on setup with "Failed: sglang-cpu server for refused'),
                           ("test_agreement[x]@served", "70.4", None), ("test_kl[x]@served", "40.2", "")]:
        case = ET.SubElement(suite, "testcase", classname=f"conformance.suites.{name[5:name.index('[')]}.t", name=name, time=t)
        if error is not None:
            ET.SubElement(case, "error" if error else "failure", message=error or "top-k KL 0.004 > limit")
    ET.ElementTree(suite).write(tmp_path / "junit.xml")
    assert night_plan.measured_costs([tmp_path]) == {"served": {"agreement": 70.4, "kl": 40.2}}


def test_plan_releases_prints_the_shards_through_the_console_script():
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "plan", "--releases", "0.5.11..0.5.23", "--tier", "nightly",
                          "--night", "2026-11-28", "--shards", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    nightly = len(plan().cells)  # the tier's cells the night's suites bind (the rest are "left out")
    assert f"13 releases x {nightly} cells" in out.stdout and "shard 1/" in out.stdout and "every release sees all" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "conformance.cli", "plan", "--releases", "0.5.16", "--shards", "two"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--shards: expected a positive number or auto" in bad.stderr


def test_history_shard_runs_only_its_part_of_each_release(monkeypatch, tmp_path):
    """``history --shard K/N``: the shard's releases only; a release's once-a-night checks
    only on the shard that owns them; its cells by id."""
    p = plan()
    k = next(s for s in p.shards if any(not part.checks for part in s.parts))
    args = argparse.Namespace(shard=f"{k.index}/{len(p.shards)}", tier="nightly", night=NIGHT.isoformat(), budget=None, fill=None, rerun_unexplained=False)
    shard = history.shard_of(args, RELEASES, ())
    assert shard == k
    calls = []
    monkeypatch.setattr(history, "ensure_venv", lambda r, root, **kw: tmp_path)
    monkeypatch.setattr(history, "probe_in", lambda venv: {"version": "x", "strategies": ["no_buffer", "extra_buffer", "extra_buffer_lazy"]})
    monkeypatch.setattr(history, "summary_of", lambda f: "probe")
    monkeypatch.setattr(history, "validate_rows", lambda r, v, t: calls.append(("validate", r)) or [])
    monkeypatch.setattr(history, "pool_rows", lambda r, v, t, machine: calls.append(("pool", r)) or [])
    monkeypatch.setattr(history, "sglang_cpu_rows", lambda r, v, f, **kw: calls.append(("cpu", r, kw["cells"], kw["requested"])) or [])
    history.history([part.release for part in shard.parts], venv_dir=tmp_path, tier="nightly", log=lambda s: None, shard=shard)
    for part in shard.parts:
        assert ("cpu", part.release, part.cells, True) in calls
        assert (("validate", part.release) in calls) == bool(part.checks)
    with pytest.raises(KitError, match="--shard goes with --releases"):
        history.shard_of(args, [], ())


def test_cells_no_suite_of_the_night_binds_are_left_out_and_named():
    """The PD transfer-failure cells are bound only by the disagg suite, which the night does
    not run: they are not planned (no shard spends time on a cell that runs nothing, and
    their fault counts as no covered axis value), and the plan, every shard and the printed
    plan name each with why; a night that runs disagg plans them."""
    cells = nightly_cells()
    pd_only = {c.id for c in cells if not any(c.fault.binds_suite(s) for s in history.CPU_SUITES)}
    assert pd_only and all("disagg_transfer_fail" in c for c in pd_only)
    p = plan()
    assert {c for c, _ in p.left_out} == pd_only and not pd_only & {u.cell.id for u in p.units}
    assert all("its suites: disagg" in why for _, why in p.left_out)
    assert all(s.left_out == p.left_out for s in p.shards)
    assert {x["cell"] for x in p.coverage()["left_out"]} == pd_only
    assert all(f"left out: {c}" in p.render() for c in pd_only)
    with_pd = plan_night(RELEASES, cells, Costs.load(), night=NIGHT, tier="nightly", budget=None, suites=(*history.CPU_SUITES, "disagg"))
    assert not with_pd.left_out and pd_only <= {u.cell.id for u in with_pd.units}


def history_of(tmp_path, units, status="pass"):
    """A history.json whose server rows are these (release, cell) units, each with one row
    of this status (``units`` may map a unit to its own status)."""
    rows = [{"release": r, "check": "sglang-cpu:kl", "status": units[(r, c)] if isinstance(units, dict) else status, "reason": "",
             "cell": c, "replay": "", "known_bug": ""} for r, c in units]
    rows.append({"release": "0.5.16", "check": "install", "status": "pass", "reason": "venv", "cell": "", "replay": "", "known_bug": ""})
    path = tmp_path / "history.json"
    path.write_text(json.dumps({"rows": rows}))
    return Fill.load(path)


def test_a_fill_plans_only_what_the_history_lacks(tmp_path):
    """``plan --fill HISTORY``: the units the history holds are not planned again; those that
    ran count as covered, so the fill plus the history meet the night's coverage; a release
    whose units it refused (n/a only) gets other cells for its values, never a refused one
    again; no slice."""
    full = plan()
    old = RELEASES[:6]
    ran = {(u.release, u.cell.id): "pass" for u in full.units if u.release in old}
    ran |= {(u.release, u.cell.id): "na" for u in full.units if u.release == "0.5.17"}
    fill = plan(fill=history_of(tmp_path, ran))
    mine = {(u.release, u.cell.id) for u in fill.units}
    assert mine and not mine & set(ran) and {u.why for u in fill.units} <= {"axis", "pair", "spread"}
    assert not [part for s in fill.shards for part in s.parts if part.checks]  # the night's once-a-night checks ran
    assert not [u for u in fill.units if u.release in old and u.why == "axis"]  # their values all ran
    assert [u for u in fill.units if u.release == "0.5.17" and u.why == "axis"]  # refused: other cells tried
    cov = fill.coverage()
    assert cov["releases_missing_values"] == {} and cov["pairs_covered"] == cov["pairs"] and cov["spread_cells_short"] == []
    assert fill.prior == {k for k, v in ran.items() if v == "pass"}
    assert fill.to_json()["fill"] == str(tmp_path / "history.json") and f"{len(fill.units)} to run" in fill.render()
    assert fill.render().startswith(f"fill of {tmp_path / 'history.json'} ({len(fill.prior)} units ran there)")


def test_a_fill_of_a_complete_history_plans_nothing_and_its_coverage_counts_the_history(tmp_path):
    """A history holding all of a night's units leaves nothing to fill; the same plan without
    the history's units (seeded) reports the values and cells it then lacks, so the coverage
    line does read the history."""
    full = plan()
    fill = plan(fill=history_of(tmp_path, [(u.release, u.cell.id) for u in full.units]))
    assert fill.units == () and fill.shards == ()
    cov = fill.coverage()
    assert cov["releases_missing_values"] == {} and cov["spread_cells_short"] == [] and cov["pairs_covered"] == cov["pairs"]
    seeded = night_plan.NightPlan(**{**fill.__dict__, "prior": frozenset()}).coverage()
    assert set(seeded["releases_missing_values"]) == set(RELEASES) and seeded["spread_cells_short"] and seeded["pairs_covered"] == 0


def test_a_fill_reads_only_a_history_and_goes_with_a_shard(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(KitError, match=r"^--fill: .*bad.json is not a history.json with rows"):
        Fill.load(tmp_path / "bad.json")
    with pytest.raises(KitError, match="--fill: .*missing.json is not a history.json"):
        Fill.load(tmp_path / "missing.json")
    args = argparse.Namespace(shard=None, tier="nightly", night=NIGHT.isoformat(), budget=None, fill=str(tmp_path / "bad.json"), rerun_unexplained=False)
    with pytest.raises(KitError, match="--fill goes with --shard K/N"):
        history.shard_of(args, RELEASES, ())


def test_history_fill_shard_is_shard_k_of_the_printed_fill(tmp_path):
    fill = history_of(tmp_path, [(u.release, u.cell.id) for u in plan().units if u.release == "0.5.23"])
    p = plan(fill=fill)
    args = argparse.Namespace(shard=f"1/{len(p.shards)}", tier="nightly", night=NIGHT.isoformat(), budget=None, fill=fill.source, rerun_unexplained=False)
    assert history.shard_of(args, RELEASES, ()) == p.shards[0]
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "plan", "--releases", "0.5.11..0.5.23", "--tier", "nightly",
                          "--night", "2026-11-28", "--fill", fill.source], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"fill of {fill.source}" in out.stdout and f"shard 1/{len(p.shards)}" in out.stdout, out.stderr


def test_a_fill_runs_again_what_another_kit_failed_and_no_known_bug_explains(tmp_path):
    """``--rerun-unexplained``: a unit whose FAIL no known bug explains, run by another kit
    (the shards' ``kit`` records), is planned again (why "rerun"); one this kit ran, one a
    known bug explains and one that passed are not."""
    units = [(u.release, u.cell.id) for u in plan().units]
    stale, mine, known, green = units[:4]
    rows = [{"release": r, "check": "sglang-cpu:kl", "status": st, "reason": "", "cell": c, "replay": "", "known_bug": kb}
            for (r, c), st, kb in ((stale, "fail", ""), (mine, "fail", ""), (known, "fail", "some-bug"), (green, "pass", ""))]
    def parts(*units):
        out = {}
        for r, c in units:
            out.setdefault(r, {"cells": []})["cells"].append(c)
        return out

    shards = [{"kit": {"commit": "old", "time": 1}, "parts": parts(stale, known, green)}, {"kit": {"commit": "new", "time": 2}, "parts": parts(mine)}]
    path = tmp_path / "history.json"
    path.write_text(json.dumps({"rows": rows, "shards": shards}))
    fill = Fill.load(path, rerun_unexplained_for="new")
    assert fill.rerun == {stale}
    assert Fill.load(path).rerun == frozenset() and Fill.load(path, rerun_unexplained_for="old").rerun == {mine}
    p = plan(fill=fill)
    assert [(u.release, u.cell.id) for u in p.units if u.why == "rerun"] == [stale]
    args = argparse.Namespace(shard=None, tier="nightly", night=NIGHT.isoformat(), budget=None, fill=None, rerun_unexplained=True)
    with pytest.raises(KitError, match="--rerun-unexplained goes with --fill FILE"):
        history.fill_of(args)


def test_a_value_every_tried_holder_of_which_a_release_refused_is_refused_not_missing(tmp_path):
    """A release that refused (n/a only) every cell offering a value does not accept it: the
    fill plans no other unit for it there (none is left), and the coverage lists it as
    refused, not missing; with one holder left untried the fill plans that one instead."""
    cells = nightly_cells()
    value = ("tree_core", "python")
    holders = [c.id for c in cells if value in axis_values(c)]
    assert len(holders) >= 2
    fill = plan(fill=history_of(tmp_path, {("0.5.11", c): "na" for c in holders}))
    assert not [u for u in fill.units if u.release == "0.5.11" and value in axis_values(u.cell)]
    cov = fill.coverage()
    assert "tree_core=python" in cov["releases_refused_values"]["0.5.11"] and "0.5.11" not in cov["releases_missing_values"]
    assert "release-values refused: n/a there" in fill.render()
    (tmp_path / "one").mkdir()
    one_left = plan(fill=history_of(tmp_path / "one", {("0.5.11", c): "na" for c in holders[1:]}))
    assert [u.cell.id for u in one_left.units if u.release == "0.5.11" and value in axis_values(u.cell)] == [holders[0]]
    assert "0.5.11" not in one_left.coverage()["releases_refused_values"]


def test_a_value_sglangs_own_na_line_quotes_is_declined_by_that_release(tmp_path):
    """A refused unit whose n/a line quotes one of its values (SGLang's "has no
    'extra_buffer_lazy'") declines that value on that release: the fill plans no other cell
    holding it there (each would be refused the same way) and counts it as refused; a line
    quoting none of its values declines nothing."""
    cells = nightly_cells()
    lazy = next(c for c in cells if c.strategy.name == "extra_buffer_lazy")
    path = tmp_path / "history.json"
    row = {"release": "0.5.11", "check": "sglang-cpu", "status": "na", "cell": lazy.id, "replay": "", "known_bug": "",
           "reason": "sglang 0.5.11: --mamba-scheduler-strategy has no 'extra_buffer_lazy' (choices: auto, no_buffer, extra_buffer)"}
    path.write_text(json.dumps({"rows": [row]}))
    fill = plan(fill=Fill.load(path))
    assert ("0.5.11", "strategy", "extra_buffer_lazy") in fill.declined
    assert not [u for u in fill.units if u.release == "0.5.11" and u.cell.strategy.name == "extra_buffer_lazy"]
    assert [u for u in fill.units if u.release == "0.5.12" and u.cell.strategy.name == "extra_buffer_lazy"]  # another release still asked
    assert "strategy=extra_buffer_lazy" in fill.coverage()["releases_refused_values"]["0.5.11"]
    path.write_text(json.dumps({"rows": [{**row, "reason": "SGLang refuses the cell's server options at start: out of memory"}]}))
    vague = plan(fill=Fill.load(path))
    assert not vague.declined and [u for u in vague.units if u.release == "0.5.11" and u.cell.strategy.name == "extra_buffer_lazy"]
