"""A strategy outside SGLang 0.5.23's PD contract (``extra_buffer_lazy``): the kit's engines
keep 0.5.23's refusal without a launch, real SGLang answers for itself (0.5.19 and later stop
at start, the kit reports SGLang's line as ``na``; 0.5.13-0.5.18 serve it), and a start failure
that is not SGLang refusing its arguments stays a failure."""

from __future__ import annotations

from pathlib import Path

from conformance.matrix.cells import load_matrix
from conformance.targets.disagg import not_applicable, pd_launch_refusal
from conformance.targets.pd_launch import LAZY_REFUSAL

#: SGLang 0.5.23's refusal as its PD decode server logs it (arg_groups/mamba_hook.py).
REFUSED_LOG = """[2026-11-27 15:30:01] server_args=...
Traceback (most recent call last):
  File "/usr/lib/python3.11/site-packages/sglang/launch_server.py", line 30, in <module>
    server_args = prepare_server_args(sys.argv[1:])
  File "/usr/lib/python3.11/site-packages/sglang/srt/server_args.py", line 6120, in prepare_server_args
    return ServerArgs.from_cli_args(raw_args)
  File "/usr/lib/python3.11/site-packages/sglang/srt/arg_groups/mamba_hook.py", line 124, in validate_mamba_extra_buffer
    assert view.disaggregation_mode == "null", (
AssertionError: extra_buffer_lazy unsupported under PD disaggregation; use --mamba-radix-cache-strategy extra_buffer.
"""
#: A crash after the arguments resolved (the scheduler died loading the model): not a refusal.
CRASH_LOG = """Traceback (most recent call last):
  File "/usr/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 4623, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args)
RuntimeError: CUDA driver version is insufficient for CUDA runtime version
"""


def _cell(strategy: str):
    cells = load_matrix().select(tier="premerge", models=["qwen3-next"], strategies=[strategy], faults=["none"])
    return cells[0]


def test_lazy_cells_are_na_without_a_launch_only_on_the_kits_engines():
    lazy, eager = _cell("extra_buffer_lazy"), _cell("extra_buffer")
    assert not_applicable(lazy) == LAZY_REFUSAL  # plan: 0.5.23's contract
    assert not_applicable(lazy, "reference") == LAZY_REFUSAL
    assert not_applicable(lazy, "sglang-cpu") is None and not_applicable(lazy, "sglang") is None
    assert not_applicable(eager, "reference") is None and not_applicable(eager, "sglang-cpu") is None


def test_sglangs_refusal_at_start_is_the_na_line_and_nothing_else_is(tmp_path: Path):
    lazy, eager = _cell("extra_buffer_lazy"), _cell("extra_buffer")
    assert pd_launch_refusal(lazy, tmp_path) is None  # no logs at all
    (tmp_path / f"{lazy.id}-pd-prefill.log").write_text(CRASH_LOG)
    assert pd_launch_refusal(lazy, tmp_path) is None  # a crash, not a refusal: stays a failure
    (tmp_path / f"{lazy.id}-pd-decode.log").write_text(REFUSED_LOG)
    line = pd_launch_refusal(lazy, tmp_path)
    assert line == ("SGLang refuses extra_buffer_lazy under PD disaggregation at start (decode server): AssertionError: "
                    "extra_buffer_lazy unsupported under PD disaggregation; use --mamba-radix-cache-strategy extra_buffer.")
    (tmp_path / f"{eager.id}-pd-decode.log").write_text(REFUSED_LOG)
    assert pd_launch_refusal(eager, tmp_path) is None  # inside the contract: any start failure is a failure
