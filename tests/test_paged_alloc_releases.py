"""Page sizes above 1 on releases whose paged KV allocator has only its Triton kernels.

Up to 0.5.22 ``PagedTokenToKVPoolAllocator.alloc_extend`` launches ``alloc_extend_kernel``
with no other path and no device question a platform could answer, so on CPU a page-64
server died at its first prefill ("0 active drivers").  The feature probe finds that, and
the sglang-cpu target then starts such cells under Triton's own CPU interpreter
(``TRITON_INTERPRET=1``): SGLang's own kernel runs unchanged.  These tests show the probe's
answer on both sides, the kernel failing without the interpreter and allocating pages as a
paged allocator must with it (in the 0.5.15 venv of the release-range job), and the target
setting the variable only where both hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.commands.history import default_venv_dir, ensure_venv, venv_env
from conformance.sglang_api.probes import Features
from conformance.targets import sglang_cpu

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "paged_alloc_probe.py"


def _run_probe(python: str, env: dict) -> dict:
    out = subprocess.run([python, str(PROBE)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.release_range
@pytest.mark.xdist_group("release_range")
@pytest.mark.timeout(1800)
def test_an_old_releases_paged_kernel_needs_the_interpreter_and_allocates_pages_under_it():
    venv = ensure_venv("0.5.15", default_venv_dir())
    env = {k: v for k, v in venv_env(venv).items() if k != sglang_cpu.TRITON_INTERPRET}
    plain = _run_probe(str(venv / "bin" / "python"), env)
    assert plain["triton_only"] is True
    assert "active drivers" in plain["error"], plain  # what a page-64 server died of at its first prefill
    interpreted = _run_probe(str(venv / "bin" / "python"), env | {sglang_cpu.TRITON_INTERPRET: "1"})
    # request 0 continues page 7 (slots 30, 31) then takes free page 2; request 1 takes page 3
    assert interpreted == {"triton_only": True, "indices": [30, 31, 8, 9, 12, 13, 14]}


def test_the_installed_release_asks_the_platform_and_needs_no_interpreter():
    assert _run_probe(sys.executable, dict(os.environ))["triton_only"] is False


@pytest.mark.parametrize(("page_size", "triton_only", "expected"), [(64, True, "1"), (1, True, None), (64, False, None)])
def test_the_target_starts_a_paged_cell_under_the_interpreter_only_where_the_release_needs_it(monkeypatch, page_size, triton_only, expected):
    from conformance.sglang_api import probes

    monkeypatch.setattr(probes, "probe", lambda: Features(version="0.5.99", paged_alloc_triton_only=triton_only))
    cell = SimpleNamespace(page_size=page_size)
    assert sglang_cpu._paged_kernels_need_interpreter(cell) is (expected is not None)
    assert (sglang_cpu.TRITON_INTERPRET in sglang_cpu.SGLangCpuTarget().env(_cell(page_size))) is (expected is not None)


def _cell(page_size: int):
    from conformance.matrix.cells import load_matrix

    return next(c for c in load_matrix().select(target="sglang-cpu", tier="nightly") if c.page_size == page_size)
