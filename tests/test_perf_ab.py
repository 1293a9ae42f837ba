"""The paired A/B perf test (issue 26, finding 9): the verdict flags a few percent that
``compare``'s thresholds cannot see, holds a clean pair to its stated false-flag rate, and
refuses to judge too few pairs; the graded fault slows a step by its grade and nothing else;
the pair driver interleaves in a random order and reads SGLang's own timings.

The detection rates on real SGLang are measured by ``bench/bench_perf_ab.py`` (docs/perf.md).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conformance.checks.perf_ab import ALPHA, MIN_PAIRS, PairTiming, ab_verdict
from conformance.errors import KitError
from conformance.matrix.faults import PAIRED_AB, SGLANG_FAULT_ENV, STEP_SLOWDOWN_ENV
from conformance.suites.perf import ab
from conformance.report.perf import DEFAULT_THRESHOLDS
from conformance.sglang_plugins.faults import catalogue
from conformance.sglang_plugins.faults import step_slowdown as slowdown
from conformance.sglang_plugins.faults.spec import FaultInstallError


def noisy_pairs(n: int, slowdown_factor: float, *, seed: int, cv: float = 0.15, cpu_cv: float = 0.1) -> list[PairTiming]:
    """Pairs whose two sides share a load factor (drifting, like a shared machine) and
    each carry their own noise; B is ``slowdown_factor`` slower (wall and CPU time alike).
    ``cpu_cv`` 0.1 per side: a pair's CPU log ratio with SD 0.14, the median measured on
    sglang-cpu (0.10 to 0.29 in session 5's nine clean crossover runs)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        load = rng.uniform(1.0, 4.0)
        a = [load * rng.lognormvariate(0, c) for c in (cv, cv, cpu_cv)]
        b = [slowdown_factor * load * rng.lognormvariate(0, c) for c in (cv, cv, cpu_cv)]
        out.append(PairTiming(0.05 * a[0], 0.05 * b[0], 0.01 * a[1], 0.01 * b[1], 0.04 * a[2], 0.04 * b[2]))
    return out


def test_a_ten_percent_slowdown_is_flagged_that_compare_threshold_never_flags() -> None:
    """Old behaviour: compare flags a time ratio only beyond +50% and a throughput ratio beyond
    +600% (DEFAULT_THRESHOLDS), so +10% is invisible; the paired test sees it."""
    assert DEFAULT_THRESHOLDS["time"] > 0.1 and DEFAULT_THRESHOLDS["throughput"] > 0.1
    flagged = [ab_verdict(noisy_pairs(40, 1.10, seed=s)).flagged for s in range(20)]
    assert sum(flagged) >= 18, flagged


def test_a_clean_pair_is_flagged_at_about_the_stated_rate() -> None:
    flagged = [ab_verdict(noisy_pairs(30, 1.0, seed=s)).flagged for s in range(200)]
    assert sum(flagged) <= 2 * ALPHA * 200, sum(flagged)
    assert ab_verdict(noisy_pairs(30, 1.0, seed=0)).alpha == ALPHA


def test_a_faster_b_is_not_a_slowdown() -> None:
    v = ab_verdict(noisy_pairs(40, 0.8, seed=1))
    assert not v.flagged and all(t.median_ratio < 1 for t in v.tests) and "no change" in v.line()


def test_too_few_pairs_or_missing_timings_refuse_to_judge() -> None:
    with pytest.raises(KitError, match="usable pairs"):
        ab_verdict(noisy_pairs(MIN_PAIRS - 1, 2.0, seed=0))
    broken = [PairTiming(0.0, 0.1, 0.01, 0.01, 0.02, 0.02)] * 30
    with pytest.raises(KitError, match="ttft: 0 usable pairs of 30"):
        ab_verdict(broken)
    with pytest.raises(KitError, match="alpha"):
        ab_verdict(noisy_pairs(30, 1.0, seed=0), alpha=1.5)


def test_identical_sides_are_no_change() -> None:
    same = [PairTiming(0.05, 0.05, 0.01, 0.01, 0.02, 0.02)] * 20
    v = ab_verdict(same)
    assert not v.flagged and all(t.p_value == 1.0 and t.median_ratio == 1.0 for t in v.tests)


def test_the_graded_fault_works_its_grade_of_the_step_and_returns_the_result(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    slept: list[float] = []
    monkeypatch.setattr(slowdown, "busy", slept.append)
    monkeypatch.setattr(slowdown, "fired", lambda *a, **k: None)
    ticks = iter([1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: next(ticks))
    grade_file = tmp_path / "g"
    grade_file.write_text("0.2\n")
    monkeypatch.setenv(slowdown.GRADE_ENV, f"@{grade_file}")
    assert slowdown.slow_step(lambda x, y=0: x + y, 1, y=2) == 3
    assert slept == [pytest.approx(0.1)]  # 0.2 x a 0.5 s step
    grade_file.write_text("0\n")
    assert slowdown.slow_step(lambda: "out") == "out" and slept == [pytest.approx(0.1)]  # grade 0: no extra work
    monkeypatch.setenv(slowdown.GRADE_ENV, "0.05")
    slowdown.slow_step(lambda: None)
    assert slept[-1] == pytest.approx(0.025)
    monkeypatch.delenv(slowdown.GRADE_ENV)
    assert slowdown.grade() == slowdown.DEFAULT_GRADE


def test_the_extra_work_is_busy_not_a_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleep would give the core away (and come back late on a loaded machine): busy() never
    sleeps, and runs for the time asked."""
    import time

    monkeypatch.setattr(slowdown.time, "sleep", lambda s: pytest.fail(f"slept {s}"))
    wall0 = time.perf_counter()
    slowdown.busy(0.05)
    assert time.perf_counter() - wall0 >= 0.05


def test_a_bad_grade_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(slowdown.GRADE_ENV, "ten percent")
    with pytest.raises(FaultInstallError, match=r"HYBRID_CONFORMANCE_STEP_SLOWDOWN: 'ten percent' is not a fraction"):
        slowdown.grade()
    monkeypatch.setenv(slowdown.GRADE_ENV, "-1")
    with pytest.raises(FaultInstallError, match="outside 0..100"):
        slowdown.grade()


def test_the_graded_fault_is_catalogued_around_the_model_step() -> None:
    fault = catalogue.get_fault("step_slowdown")
    assert fault is slowdown.FAULT and fault.suites == () and fault.seen_by == (PAIRED_AB,)  # no suite's check sees +10%
    assert [(h.target, h.how) for h in fault.hooks] == [(slowdown.TARGET, "around")]


class FakeStream:
    def __init__(self, meta: dict, n: int) -> None:
        self.meta, self.output_ids, self.client_ttft_s, self.client_total_s = meta, tuple(range(n)), 0.5, 1.0


def test_pairs_are_interleaved_in_a_random_order_and_timed_by_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_stream(client, prompt, new_tokens, *, timeout):
        calls.append(client)
        ttft = 0.1 if client == "a" else 0.2
        return FakeStream({"first_token_latency": ttft, "e2e_latency": ttft + 0.15}, new_tokens)

    monkeypatch.setattr(ab, "stream_one", fake_stream)
    plan = ab.AbPlan(pairs=20, warmup=2, new_tokens=16, together=False)
    pairs = ab.measure_pairs("a", "b", plan, vocab_size=100, seed=0)
    assert len(pairs) == 20 and len(calls) == 2 * (20 + 2)
    measured = [tuple(calls[i:i + 2]) for i in range(4, len(calls), 2)]
    assert set(measured) == {("a", "b"), ("b", "a")}  # both orders occur
    assert all(p.ttft_a == 0.1 and p.ttft_b == 0.2 and p.decode_per_token_a == pytest.approx(0.01) for p in pairs)
    swapped = ab.oriented(pairs, "a")
    assert swapped[0].ttft_b == 0.1 and ab.oriented(pairs, "b") == pairs


def test_both_sides_of_a_pair_are_in_flight_at_the_same_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default pair: A and B answer the same prompt at once (each waits for the other to
    have started), so a burst of the machine's load falls on both; each keeps its own timing."""
    import threading

    both = threading.Barrier(2, timeout=10)
    prompts: list[tuple[str, tuple]] = []

    def fake_stream(client, prompt, new_tokens, *, timeout):
        prompts.append((client, tuple(prompt)))
        both.wait()  # a BrokenBarrierError after 10 s if the other side is not in flight
        ttft = 0.1 if client == "a" else 0.3
        return FakeStream({"first_token_latency": ttft, "e2e_latency": ttft + 0.15}, new_tokens)

    monkeypatch.setattr(ab, "stream_one", fake_stream)
    pairs = ab.measure_pairs("a", "b", ab.AbPlan(pairs=10, warmup=1, together=True), vocab_size=100, seed=0)
    assert len(pairs) == 10 and all(p.ttft_a == 0.1 and p.ttft_b == 0.3 for p in pairs)
    by_client = {c: [pr for cc, pr in prompts if cc == c] for c in ("a", "b")}
    assert by_client["a"] == by_client["b"] and len(set(by_client["a"])) == 11  # the same fresh prompt on both, per pair


def test_an_answer_without_timings_is_one_line() -> None:
    s = FakeStream({}, 1)
    with pytest.raises(KitError, match="1 output tokens"):
        ab.side_timing(s)
    s = FakeStream({}, 4)
    assert ab.side_timing(s) == (0.5, pytest.approx(0.5 / 3))  # the client's stream times


def test_the_grade_files_slow_one_side(tmp_path: Path) -> None:
    pair = ab.GradedPair({}, {s: tmp_path / f"{s}.grade" for s in ab.SIDES})
    pair.grade("a", 0.1)
    assert (tmp_path / "a.grade").read_text().strip() == "0.1" and float((tmp_path / "b.grade").read_text()) == 0.0


# ---------------------------------------------------------------- real SGLang (fault_probe)
#: Probed here rather than in test_sglang_fault_probes (it needs two servers).
AB_PROBED = ("step_slowdown",)


@pytest.mark.fault_probe
@pytest.mark.timeout(900)
def test_step_slowdown_slows_the_graded_side_of_a_real_sglang_pair(tmp_path: Path) -> None:
    """Direct probe: +100% of a step's work on one side moves its TTFT and decode time per
    token (raw medians of B/A) and the paired test flags it; with both sides at grade 0 the
    same pair is not flagged at the stated rate's test."""
    from sglang_cpu_probes import require_sglang

    from conformance.matrix.cells import load_matrix
    from conformance.session.options import resolve
    from conformance.session.suite_support import vocab_size
    from conformance.targets import preimport

    require_sglang()
    cell = next(c for c in load_matrix().cells if c.id == "qwen3-next-80b-extra_buffer-p1-t256")
    opts = resolve(lambda flag: {"--target": "sglang-cpu"}.get(flag))
    plan = ab.AbPlan(pairs=16)
    try:
        with ab.graded_pair(cell, opts, work_dir=tmp_path) as pair:
            vocab = vocab_size(pair.endpoints["a"])
            pair.grade("b", 1.0)
            slowed = ab_verdict(ab.measure_pairs(*pair.clients, plan, vocab_size=vocab, seed="probe-slow"))
            pair.grade("b", 0.0)
            clean = ab_verdict(ab.measure_pairs(*pair.clients, plan, vocab_size=vocab, seed="probe-clean"))
    finally:
        preimport.stop_all()
    ratios = {t.metric: t.median_ratio for t in slowed.tests}
    assert slowed.flagged and ratios["ttft"] > 1.3 and ratios["decode_per_token"] > 1.3, slowed.line()
    assert not clean.flagged, clean.line()


def test_the_perf_ab_verb_exits_1_when_a_verdict_is_wrong(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from conformance import cli

    def fake_runs(cell, opts, *, grades, repeats, plan, alpha, seed, work_dir):
        for g in grades:
            factor = 1.10 if g > 0 else 1.0
            yield ab.GradedRun(0, g, "b", ab_verdict(noisy_pairs(30, factor, seed=3), alpha=alpha), 1.0)

    monkeypatch.setattr(ab, "graded_runs", fake_runs)
    assert cli.main(["perf-ab", "--grades", "0,0.1", "--log-dir", "/tmp/unused-perf-ab"]) == 0
    out = capsys.readouterr().out
    assert "+10% on side b: SLOWER" in out and "flagged: +0% 0/1, +10% 1/1" in out

    def blind_runs(cell, opts, *, grades, repeats, plan, alpha, seed, work_dir):
        for g in grades:  # a test that sees nothing: the slowed run is "no change"
            yield ab.GradedRun(0, g, "a", ab_verdict(noisy_pairs(30, 1.0, seed=4), alpha=alpha), 1.0)

    monkeypatch.setattr(ab, "graded_runs", blind_runs)
    assert cli.main(["perf-ab", "--grades", "0,0.1", "--log-dir", "/tmp/unused-perf-ab"]) == 1
    assert "<- WRONG" in capsys.readouterr().out


def test_a_fault_run_puts_the_fault_on_the_drawn_side_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``fault_runs``: the drawn side starts with the seeded fault at its defaults (no grade
    file), the other with no fault switch at all, whatever the caller's environment holds."""
    import contextlib
    import os

    seen: list[dict[str, dict]] = []

    @contextlib.contextmanager
    def fake_pair(cell, options, envs, *, work_dir):
        with ab._environ(envs["a"]):
            got_a = {k: os.environ.get(k) for k in (SGLANG_FAULT_ENV, STEP_SLOWDOWN_ENV)}
        with ab._environ(envs["b"]):
            got_b = {k: os.environ.get(k) for k in (SGLANG_FAULT_ENV, STEP_SLOWDOWN_ENV)}
        seen.append({"a": got_a, "b": got_b})
        yield {"a": type("E", (), {"client": "a"})(), "b": type("E", (), {"client": "b"})()}

    monkeypatch.setenv(SGLANG_FAULT_ENV, "cow_skipped")  # a stray switch in the caller's environment
    monkeypatch.setenv(STEP_SLOWDOWN_ENV, "0.5")
    monkeypatch.setattr(ab, "started_pair", fake_pair)
    monkeypatch.setattr("conformance.session.suite_support.vocab_size", lambda endpoint: 100)

    def fake_measure(a, b, plan, *, vocab_size, seed, **_):
        slow = {"a": 1.0, "b": 1.0, **{side: 1.3 for side, env in seen[-1].items() if env[SGLANG_FAULT_ENV]}}
        return [PairTiming(0.1 * slow["a"], 0.1 * slow["b"], 0.01 * slow["a"], 0.01 * slow["b"], 0.05 * slow["a"], 0.05 * slow["b"])
                for _ in range(12)]

    monkeypatch.setattr(ab, "measure_pairs", fake_measure)
    runs = list(ab.fault_runs(None, None, fault="step_slowdown", repeats=4, plan=ab.AbPlan(), alpha=ALPHA, seed=1, work_dir=tmp_path))
    for run, envs in zip(runs, seen):
        other = "a" if run.slowed == "b" else "b"
        assert envs[run.slowed] == {SGLANG_FAULT_ENV: "step_slowdown", STEP_SLOWDOWN_ENV: None}
        assert envs[other] == {SGLANG_FAULT_ENV: None, STEP_SLOWDOWN_ENV: None}
        assert run.fault == "step_slowdown" and run.verdict.flagged and run.right and run.what == f"step_slowdown on side {run.slowed}"
    assert {r.slowed for r in runs} == {"a", "b"}  # the side is drawn
    clean = list(ab.fault_runs(None, None, fault=None, repeats=2, plan=ab.AbPlan(), alpha=ALPHA, seed=1, work_dir=tmp_path))
    assert all(e == {SGLANG_FAULT_ENV: None, STEP_SLOWDOWN_ENV: None} for envs in seen[-2:] for e in envs.values())
    assert all(not r.changed and not r.verdict.flagged and r.right for r in clean)


def test_the_perf_ab_verb_runs_a_seeded_fault_on_one_side(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    import json

    from conformance import cli

    def fake_runs(cell, opts, *, fault, repeats, plan, alpha, seed, work_dir):
        factor = 1.10 if fault else 1.0
        yield ab.GradedRun(0, 0.0, "a", ab_verdict(noisy_pairs(30, factor, seed=3), alpha=alpha), 1.0, fault or "")

    monkeypatch.setattr(ab, "fault_runs", fake_runs)
    out_json = tmp_path / "ab.json"
    assert cli.main(["perf-ab", "--fault", "step_slowdown", "--json", str(out_json), "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step_slowdown on side a: SLOWER" in out and "flagged: 1/1 (fault step_slowdown)" in out
    row = json.loads(out_json.read_text())["runs"][0]
    assert row["fault"] == "step_slowdown" and row["flagged"] and row["line"].startswith("SLOWER")
    assert cli.main(["perf-ab", "--fault", "none", "--json", str(out_json), "--log-dir", str(tmp_path)]) == 0
    assert "+0% on side a: no change" in capsys.readouterr().out and not json.loads(out_json.read_text())["runs"][0]["flagged"]
    assert cli.main(["perf-ab", "--fault", "no_such_fault"]) != 0
    err = capsys.readouterr().err
    assert "--fault: unknown seeded SGLang fault 'no_such_fault'" in err and "Traceback" not in err
    assert cli.main(["perf-ab", "--fault", "step_slowdown", "--grades", "0.1"]) != 0
    assert "--fault and --grades: give one" in capsys.readouterr().err


def asymmetric_pairs(sides: list[str], grade: float, *, seed: int, asym: float = 1.6, cv: float = 0.1) -> list[PairTiming]:
    """Raw (unoriented) pairs of two servers where B's process is ``asym`` x slower than A's
    (as measured on sglang-cpu under load), the side ``sides[i]`` slowed by ``grade``."""
    rng = random.Random(seed)
    out = []
    for s in sides:
        load = rng.uniform(1.0, 3.0)
        t = {side: load * (asym if side == "b" else 1.0) * (1 + grade if side == s else 1.0) * rng.lognormvariate(0, cv) for side in ab.SIDES}
        out.append(PairTiming(0.05 * t["a"], 0.05 * t["b"], 0.01 * t["a"], 0.01 * t["b"], 0.04 * t["a"], 0.04 * t["b"]))
    return out


def test_a_crossover_cancels_a_difference_between_the_two_servers() -> None:
    """Before: one drawn side slowed for the whole run, so a server process 1.6x slower than its
    twin is flagged on a clean pair (side B drawn) and hides +10% (side A drawn). A crossover
    (each block of two pairs slows each side once) judged block by block sees +10% either way
    and leaves the clean pair alone."""
    rng = random.Random(5)
    fixed_b, fixed_a = ["b"] * 40, ["a"] * 40
    assert ab_verdict(ab.oriented(asymmetric_pairs(fixed_b, 0.0, seed=1), "b")).flagged  # old: a false flag
    assert not ab_verdict(ab.oriented(asymmetric_pairs(fixed_a, 0.10, seed=2), "a")).flagged  # old: +10% missed
    flagged_clean = flagged_slow = 0
    for trial in range(40):
        sides = ab.crossover_sides(20, rng)
        assert all(sorted(sides[i:i + 2]) == ["a", "b"] for i in range(0, 40, 2))
        clean = ab_verdict(ab.oriented(asymmetric_pairs(sides, 0.0, seed=100 + trial), sides), block=2)
        slow = ab_verdict(ab.oriented(asymmetric_pairs(sides, 0.10, seed=200 + trial), sides), block=2)
        flagged_clean += clean.flagged
        flagged_slow += slow.flagged
        assert slow.tests[0].pairs == 20  # blocks
    assert flagged_clean <= 4 and flagged_slow >= 38, (flagged_clean, flagged_slow)
    assert all(0.9 < t.median_ratio < 1.3 for t in slow.tests)  # the per-pair slowdown, not the servers' 1.6


def test_a_crossover_moves_the_grade_before_each_measured_pair(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """graded_runs: per pair the grade files name that pair's slowed side (never during warm-up),
    and the verdict is taken on blocks."""
    import contextlib

    pair = ab.GradedPair({s: type("E", (), {"client": s, "process": type("P", (), {"pid": pid})()})() for s, pid in (("a", 11), ("b", 12))},
                         {s: tmp_path / f"{s}.grade" for s in ab.SIDES})
    cpu = {11: 0.0, 12: 0.0}
    monkeypatch.setattr(ab, "tree_cpu_s", lambda pid: cpu[pid])
    for path in pair.grade_files.values():
        path.write_text("0.0\n")

    @contextlib.contextmanager
    def fake_pair(cell, options, *, work_dir):
        yield pair

    seen: list[dict[str, float]] = []

    def fake_stream(client, prompt, new_tokens, *, timeout):
        grade = float((tmp_path / f"{client}.grade").read_text())
        seen.append({"client": client, "grade": grade})
        cpu[11 if client == "a" else 12] += 0.2 * (1 + grade)
        return FakeStream({"first_token_latency": 0.1 * (1 + grade), "e2e_latency": 0.1 * (1 + grade) + 0.15 * (1 + grade)}, new_tokens)

    monkeypatch.setattr(ab, "graded_pair", fake_pair)
    monkeypatch.setattr(ab, "stream_one", fake_stream)
    monkeypatch.setattr("conformance.session.suite_support.vocab_size", lambda endpoint: 100)
    plan = ab.AbPlan(pairs=20, warmup=2)
    runs = list(ab.graded_runs(None, None, grades=[0.2], repeats=1, plan=plan, alpha=ALPHA, seed=3, work_dir=tmp_path))
    assert len(runs) == 1 and runs[0].slowed == ab.CROSSOVER and runs[0].verdict.flagged and runs[0].right
    assert all(t.pairs == 10 for t in runs[0].verdict.tests) and len(runs[0].pairs) == 20
    warm, measured = seen[:4], seen[4:]
    assert all(s["grade"] == 0.0 for s in warm)
    slowed = [s["client"] for s in measured if s["grade"] > 0]
    assert len(slowed) == 20 and slowed.count("a") == slowed.count("b") == 10  # one side per pair, each side half the time
    assert runs[0].what == "+20% on each side in turn (crossover)"


def test_the_cpu_time_of_a_server_tree_is_its_own_work(tmp_path: Path) -> None:
    """``tree_cpu_s`` counts the CPU a process tree used (a child's busy work included), not the
    wall time it waited; the verdict tests the CPU metric only when every pair has it."""
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.perf_counter()\nwhile time.perf_counter()-t<0.3: pass\ntime.sleep(30)"])
    try:
        t0 = ab.tree_cpu_s(os.getpid())
        time.sleep(1.0)  # the child spins 0.3 s, then sleeps
        used = ab.tree_cpu_s(os.getpid()) - t0
        assert 0.05 < used < 0.9, used  # its work (on a loaded host: the share it got), not the 1 s of wall time
    finally:
        child.kill()
        child.wait()
    assert ab.tree_cpu_s(2 ** 22 + 7) == 0.0  # no such process
    timed = [PairTiming(0.1, 0.1, 0.01, 0.01, 0.05, 0.05 * 1.1 * (1 + 0.01 * (i % 3))) for i in range(20)]
    v = ab_verdict(timed)
    assert [t.metric for t in v.tests] == ["ttft", "decode_per_token", "cpu"] and v.flagged and v.tests[2].flagged
    with pytest.raises(KitError, match="CPU time was not measured in 1 of 20 pairs"):  # refused, not judged on wall times
        ab_verdict([*timed[:-1], PairTiming(0.1, 0.1, 0.01, 0.01)])


def test_only_the_cpu_time_is_judged() -> None:
    """A clean pair whose B process is 1.6x slower in wall time (no crossover, as with a seeded
    fault on one server) was flagged when the wall times were judged (the mutants clean run
    measured on sglang-cpu: TTFT B/A 2.07, p 0.007; two of nine clean crossover runs), not now
    that only the CPU time, each server's own work, is; +10% of CPU work is flagged either way."""
    def with_cpu(pairs: list[PairTiming], grade: float, seed: int) -> list[PairTiming]:
        rng = random.Random(seed)
        return [PairTiming(p.ttft_a, p.ttft_b, p.decode_per_token_a, p.decode_per_token_b, 0.08 * rng.lognormvariate(0, 0.03),
                           0.08 * (1 + grade) * rng.lognormvariate(0, 0.03)) for p in pairs]

    clean = with_cpu(asymmetric_pairs(["a"] * 30, 0.0, seed=7), 0.0, seed=8)
    assert ab_verdict(clean, wall=True).flagged  # old: the wall times judged, a false flag
    v = ab_verdict(clean)
    assert not v.flagged and [t.judged for t in v.tests] == [False, False, True] and "not judged" in v.line()
    slow = with_cpu(asymmetric_pairs(["a"] * 30, 0.0, seed=9), 0.10, seed=10)
    assert ab_verdict(slow).flagged and ab_verdict(slow).tests[2].flagged and ab_verdict(slow, wall=True).flagged
