"""Every seeded pool fault is caught by the pool suite; the clean target passes.

In process: each fault of ``conformance.mutants.pool_faults`` is installed with ``apply``
and the pool suite's own pieces (state machine without shrinking, scenarios) are run on
the premerge pool keys of the strategies the fault applies to; at least one must fail,
and a state-machine failure must carry hypothesis's step sequence.  End to end: one fault is loaded
as a pytest plugin into a subprocess run of ``conformance/suites/leaks/test_pool_invariants.py``,
which must fail and print the falsifying steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.sglang_api import pool as sglang_api
from conformance.sglang_api.pool_runtime import PoolKey

pytestmark = pytest.mark.pool

ROOT = Path(__file__).resolve().parents[1]
PREMERGE_KEYS = (
    PoolKey("no_buffer", 1, 256, 64),
    PoolKey("extra_buffer", 1, 256, 64),
    PoolKey("extra_buffer_lazy", 1, 256, 64),
    PoolKey("extra_buffer_lazy", 1, 256, 64, lazy_alloc_fail=True),
)


def _suite_failures(key: PoolKey) -> list[str]:
    """Run the machine and every applicable scenario; return 'what: error' for each failure."""
    from conformance.targets.pool.scenarios import SCENARIOS, run_machine

    failures = []
    checks = [("state machine", lambda: run_machine(key, examples=15, steps=25, shrink=False))]
    checks += [(name, lambda fn=fn: fn(key)) for name, (fn, strategies) in SCENARIOS.items() if key.strategy in strategies]
    for what, check in checks:
        try:
            check()
        except Exception as e:  # any failure of the suite counts as caught
            notes = "\n".join(getattr(e, "__notes__", []))
            failures.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n{notes}")
            break
    return failures


def _fault_names() -> list[str]:
    from conformance.mutants.pool_faults import FAULTS

    return list(FAULTS)


@pytest.mark.parametrize("name", _fault_names())
def test_fault_is_caught(name):
    sglang_api.require()
    from conformance.mutants.pool_faults import apply, get

    fault = get(name)
    keys = [k for k in PREMERGE_KEYS if k.strategy in fault.strategies]
    caught: list[str] = []
    with apply(name):
        for key in keys:
            caught += [f"{key.id} {f}" for f in _suite_failures(key)]
            if caught:
                break
    assert caught, f"pool fault {name} ({fault.description}) was not caught on {[k.id for k in keys]}"
    if caught[0].split(" ", 1)[1].startswith("state machine"):
        assert "state." in caught[0], f"no step sequence in the failure: {caught[0][:300]}"


def test_clean_target_passes_the_suite_pieces():
    sglang_api.require()
    for key in PREMERGE_KEYS:
        assert _suite_failures(key) == [], key.id


def test_fault_plugin_fails_the_suite_with_shrunk_steps(tmp_path):
    sglang_api.require()
    env = dict(os.environ, HYBRID_CONFORMANCE_FAULT="mamba_double_free", HYBRID_CONFORMANCE_POOL_EXAMPLES="10")
    cmd = [
        sys.executable, "-m", "pytest", str(ROOT / "conformance/suites/leaks/test_pool_invariants.py"), "-p",
        "conformance.mutants.pool_faults", "-x", "-k", "test_pool_machine and no_buffer and qwen3",
        "--tier", "premerge", "-p", "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-2000:]
    assert "pool fault injected: mamba_double_free" in out
    assert "slot_partition" in out or "sglang_checker" in out, out[-2000:]
    assert "state.arrive(" in out and "state.finish(" in out, out[-2000:]


def test_unknown_fault_is_one_clear_error():
    from conformance.errors import KitError
    from conformance.mutants.pool_faults import get

    with pytest.raises(KitError, match="unknown pool fault"):
        get("no_such_fault")


def test_each_fault_patches_the_symbol_its_record_names() -> None:
    """A pool fault's ``injected_at`` (in docs/faults.md) is the SGLang symbol its patch replaces."""
    sglang_api.require()
    from conformance.mutants.pool_faults import FAULTS

    api = sglang_api.load()
    for fault in FAULTS.values():
        patched: list[str] = []
        fault.patch(api, lambda obj, attr, value: patched.append(f"{obj.__name__}.{attr}" if isinstance(obj, type) else f".{attr}"))
        assert fault.injected_at.endswith(patched[0]), (fault.name, fault.injected_at, patched)
