"""Agreement suite (target ``sglang-cpu``): the cell's real SGLang server and a reference
engine server for the same cell answer the same scripted conversation (multi-turn chains
included); tokens, logprobs and ``cached_tokens`` must agree, and SGLang's hit on every
request must reach what its tree held for the prompt at the admission (its per-node
records: ``checks.held``) (``checks.agreement``).

This is what makes the reference engine trustworthy where SGLang cannot run (and the
kit's CPU stand-ins trustworthy where it can): a disagreement is the engine's bug, or a
stand-in op's, until shown otherwise.  On any other target the suite records why it does
not apply.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from conformance.checks.agreement import agreement_verdict
from conformance.checks.held import Expected
from conformance.programs.evidence import owed_hits
from conformance.recordings import AgreementStep
from conformance.records import Verdict
from conformance.session.suite_support import exact_mode, grids, settle, vocab_size
from conformance.targets.registry import target_for
from conformance.report.phases import timed
from conformance.targets.serving import serve_cell
from conformance.workloads.agreement import Answered, agreement_script, run_agreement

pytestmark = pytest.mark.agreement


def test_agreement_with_reference_engine(endpoint, conformance_options, tmp_path_factory, record_verdict):
    cell = endpoint.cell
    twin = target_for(endpoint).agrees_with
    if twin is None:
        settle(record_verdict(Verdict("agreement", "skip", {}, f"not applicable on target {endpoint.target}: agreement compares real SGLang on CPU with the reference engine")))
    if not exact_mode(endpoint):
        settle(record_verdict(Verdict("agreement", "skip", {}, "not applicable in bfloat16: agreement with the float32 reference engine is defined for --dtype float32")))
    ref_options = dataclasses.replace(conformance_options, target=twin)
    unsupported = target_for(ref_options).launcher(ref_options).supports(cell)
    if unsupported:
        settle(record_verdict(Verdict("agreement", "skip", {}, f"not applicable: the {twin} engine cannot serve this cell: {unsupported}")))
    chunk, grid = grids(cell)
    script = agreement_script(chunk=chunk, grid=grid, vocab_size=vocab_size(endpoint))
    served_sglang = run_agreement(endpoint.client, script, rid_tag=f"agree-{uuid.uuid4().hex[:8]}")
    log_dir = conformance_options.log_dir or tmp_path_factory.getbasetemp() / "server-logs"
    with timed(serve_cell(cell, ref_options, log_dir=log_dir / "agreement-reference"), "agreement: reference server") as ref:
        served_ref = run_agreement(ref.client, script)
    steps = [AgreementStep(a.label, a.served, b.served) for a, b in zip(served_sglang, served_ref)]
    settle(record_verdict(agreement_verdict(steps, owed=owed_by_step(endpoint, served_sglang))))


def owed_by_step(endpoint, answered: list[Answered]) -> dict[str, Expected]:
    """Per step, the hit SGLang owed its request from the server's per-node records (exact),
    or why they cannot say (bounded)."""
    return owed_hits(endpoint.log_path, endpoint.target, endpoint.cell.page_size, [(a.label, a.prompt, str(a.rid)) for a in answered])
