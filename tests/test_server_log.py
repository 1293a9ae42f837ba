"""A server death is named by its last traceback (``conformance.server_log``), and one of
SGLang's own assertions killing the server scores as SGLang's invariant catching a fault,
while a crash in the kit's own fault code or a death with no traceback does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conformance.checks.leaks import death_cause
from conformance.errors import ServerStartError
from conformance.mutants.scoring import CAUGHT, catcher, category
from conformance.server_log import SGLANG_ASSERTION, last_crash
from conformance.targets.launcher import ServerProcess

SITE = "/usr/lib/python3.11/site-packages"


def traceback(last_frame: str, source: str, exception: str) -> str:
    return (
        "[t] Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{SITE}/sglang/srt/managers/scheduler.py", line 2071, in pop_and_process\n'
        "    self.process_batch_result(tmp_batch, tmp_result)\n"
        f'  File "{last_frame}", line 296, in add_input_logprob_return_values\n'
        f"    {source}\n"
        "           ^^^^^^^^^^^^^^^^\n"
        f"{exception}\n\n"
        "[t] SIGQUIT received. signum=None, frame=None. It usually means one child failed.\n"
        "[t] Sleeping 5 seconds before crash diagnostics to let GPU activity settle.\n"
    )


SGLANG_ASSERT = traceback(f"{SITE}/sglang/srt/managers/scheduler_components/logprob_result_processor.py",
                          "assert len(req.logprob.input_token_logprobs_val) == relevant_tokens_len", "AssertionError")


def test_sglangs_own_assertion_names_the_frame_and_scores_as_caught() -> None:
    crash = last_crash("[t] Prefill batch, #new-seq: 1\n" + SGLANG_ASSERT)
    assert crash is not None and crash.sglang_assertion and crash.line == 296
    cause = death_cause("[t] Prefill batch\n" + SGLANG_ASSERT)
    assert cause.startswith(f"{SGLANG_ASSERTION} at logprob_result_processor.py:296: assert len(req.logprob")
    # the programs' death line and the mutants score
    line = f"programs: server died: server process exited with code -9; {cause}; log tail: x"
    assert catcher(line) == "SGLang's own assertion (in the server)"
    assert category([line]) == (CAUGHT, ["SGLang's own assertion (in the server)"])


def test_a_crash_in_the_kits_fault_code_or_a_library_is_not_sglangs_assertion() -> None:
    kit = traceback(f"{SITE}/conformance/sglang_plugins/faults/logprob_start_ignored.py", "assert False", "AssertionError")
    lib = traceback(f"{SITE}/torch/nn/modules/module.py", "assert x", "AssertionError")
    other = traceback(f"{SITE}/sglang/srt/mem_cache/common.py", "raise RuntimeError(msg)", "RuntimeError: boom")
    for text in (kit, lib, other):
        crash = last_crash(text)
        assert crash is not None and not crash.sglang_assertion
        line = f"programs: server died: server process exited with code -9; {death_cause(text)}"
        assert SGLANG_ASSERTION not in line and catcher(line) is None
    assert death_cause(other) == "RuntimeError: boom (raised at common.py:296: raise RuntimeError(msg))"


def test_no_traceback_or_a_later_error_line_is_not_read_as_the_crash() -> None:
    assert last_crash("[t] Prefill batch\n[t] SIGTERM received.\n") is None
    assert last_crash("[t] Scheduler hit an exception: Traceback (most recent call last):\n") is None  # cut short
    later_leak = SGLANG_ASSERT + "[t] ValueError: pool memory leak detected! [mamba] total=48\n"
    assert death_cause(later_leak).startswith("[t] ValueError: pool memory leak detected")


def test_a_restarted_servers_log_is_its_own_start_only(tmp_path: Path) -> None:
    """A restarted server appends to the same file: the earlier start's crash is not its own."""
    log = tmp_path / "cell.log"
    log.write_text(SGLANG_ASSERT)  # the first start crashed
    proc = ServerProcess("cell", [sys.executable, "-c", "print('second start'); raise SystemExit(3)"],
                         "http://127.0.0.1:1/health", log, start_timeout_s=30, poll_s=0.05)
    with pytest.raises(ServerStartError):
        proc.start()
    assert "second start" in proc.log_text() and "AssertionError" not in proc.log_text()
    assert last_crash(proc.log_text()) is None and SGLANG_ASSERTION not in (proc.exit_reason() or "")
    assert "AssertionError" in log.read_text()  # the file still holds both starts
