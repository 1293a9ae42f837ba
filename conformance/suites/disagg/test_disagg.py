"""PD disaggregation suite: per cell, a prefill server, a decode server and a router started
together as one unit (``conformance.targets.disagg.serve_pd``), compared with the same
cell's NON-PD server (the plugin's ``endpoint``, started for the cell if no other suite did).

* logprobs: PD-served tokens on a prefill-side cache hit against two cold re-prefills on the
  non-PD server (``checks.kl.kl_verdict``: exact on the CPU reference, KL-bounded on GPU);
* GSM8K: the PD answers against the non-PD answers to the same questions (agreement mode on
  CPU twins; on GPU accuracy with a Wilson interval, a paired McNemar test and SGLang's PD
  threshold history);
* leaks: idle gauges on BOTH servers after every scenario, a load timeline, and a scan of all
  three logs;
* transfer failures (cells with SGLang's own ``SGLANG_TEST_DISAGG_FAILURE_PROB`` on the decode
  server, matrix fault ``disagg_transfer_fail``): a load through the router must end each
  request served or with SGLang's transfer-failure error, some failed, a follow-up served,
  then the idle invariant on both servers before any flush (``checks.transfer_failures`` +
  ``checks.leaks``).  On those cells the three comparisons above are a stated skip (their
  requests fail on purpose), elsewhere this one is.

Each test files a ``disagg`` verdict; the report merges them per cell.  ``extra_buffer_lazy``
cells are outside SGLang 0.5.23's PD contract: on the reference engine a stated skip without a
launch; on real SGLang the release answers (0.5.19 and later refuse it at start: a stated
skip with SGLang's line; 0.5.13-0.5.18 serve it and the tests judge it), never a pass.
"""

from __future__ import annotations

import contextlib

import pytest

from conformance.checks.disagg import CHECK, disagg_verdict, threshold_history
from conformance.checks.gsm8k import gsm8k_verdict, is_correct
from conformance.checks.kl import NOISE_FACTOR, kl_verdict
from conformance.checks.leaks import leak_verdict
from conformance.checks.transfer_failures import transfer_failure_verdict
from conformance.suites.disagg.record import probe_both, record_pd_logprobs
from conformance.errors import KitError
from conformance.matrix.faults import DISAGG_FAILURE_ENV
from conformance.records import Verdict
from conformance.report.phases import timed
from conformance.session.suite_support import exact_mode, grids, no_prefill_stores, settle, sizes_for, vocab_size
from conformance.sglang_contract.metric_names import KIT_MAMBA_USED_PEAK, KV_USED_TOKENS, MAMBA_USED_TOKENS
from conformance.targets.disagg import not_applicable, pd_launch_refusal, serve_pd, target_refusal
from conformance.targets.pd_launch import transport
from conformance.workloads.gsm8k import pick_items
from conformance.workloads.gsm8k_lm_eval import LmEvalGSM8K
from conformance.workloads.prompts import prefill_hit_lengths, token_prompts
from conformance.workloads.runners import OCCUPANCY_GAUGES, generate_tokens, sample_occupancy
from conformance.workloads.transfer_failures import record_transfer_failures
from conformance.report.outcomes import note_launch, note_server

#: A PD test may start the unit and the non-PD server: four real SGLang processes on sglang-cpu
#: (over ten minutes on a loaded 2-core machine), more than the runs' per-test timeout.
pytestmark = [pytest.mark.disagg, pytest.mark.timeout(1800)]
SEEDS = {"logprobs": 21, "load": 22, "transfer_failures": 23}
#: Requests of the transfer-failure load (each fails with SGLang's per-poll probability).
TRANSFER_FAILURE_REQUESTS = 16
#: The transfer-failure load's bound: its rounds and follow-ups, each failed handshake held
#: until SGLang's bootstrap timeout (the cell's ``pd_env``).
TRANSFER_FAILURE_LOAD_S = 900.0


def _gauges(pd) -> tuple[str, ...]:
    return (MAMBA_USED_TOKENS, KV_USED_TOKENS, *pd.spec.extra_gauges)


@pytest.fixture(scope="session")
def pd_endpoint(cell, conformance_options, tmp_path_factory, request):
    """The cell's PD unit (prefill + decode + router), started once per cell (one launch)."""
    log_dir = conformance_options.log_dir or tmp_path_factory.getbasetemp() / "server-logs"
    stack = contextlib.ExitStack()
    try:
        pd = stack.enter_context(timed(serve_pd(cell, conformance_options, log_dir=log_dir), f"{conformance_options.target} PD unit"))
    except KitError as e:
        problem = str(e)
        refused = pd_launch_refusal(cell, log_dir)
        if refused:  # the release's own answer for a cell outside 0.5.23's PD contract
            raise PDRefused(refused) from None
    else:
        with stack:
            note_launch(request, cell, kind="pd")  # three processes, one launch of the cell
            note_server(request, cell, {}, pd_transfer=transport(pd.spec))
            yield pd
        return
    pytest.fail(problem, pytrace=False)


class PDRefused(KitError):
    """SGLang refused the cell's PD servers at start (its own line): the cell has no PD variant
    on this release, a stated skip for every test of the cell (the fixture keeps the error)."""


def _pd_refusal(cell, request) -> str | None:
    target = request.getfixturevalue("conformance_options").target
    return not_applicable(cell, target) or target_refusal(target)


def _bind(cell, request, record_verdict):
    """(PD unit, non-PD endpoint) for the cell; a cell without a PD variant, or whose
    transfers fail on purpose, is a stated skip."""
    reason = _pd_refusal(cell, request)
    if DISAGG_FAILURE_ENV in cell.env:
        reason = f"not applicable: this cell fails transfers on purpose ({DISAGG_FAILURE_ENV}={cell.env[DISAGG_FAILURE_ENV]}); test_pd_transfer_failures judges it"
    if reason:
        settle(record_verdict(Verdict(CHECK, "skip", reason=reason)))
    try:
        pd = request.getfixturevalue("pd_endpoint")
    except PDRefused as e:
        settle(record_verdict(Verdict(CHECK, "skip", reason=f"not applicable: {e}")))
    return pd, request.getfixturevalue("endpoint")


def test_pd_logprobs(cell, request, record_verdict):
    pd, base = _bind(cell, request, record_verdict)
    if why := no_prefill_stores(base):  # the prefill server runs the same options: nothing to hit there
        settle(record_verdict(Verdict(CHECK, "skip", reason=f"not applicable: pd_{why}")))
    size = sizes_for(pd)
    chunk, grid = grids(cell)
    vocab = vocab_size(base)
    prompts = token_prompts(prefill_hit_lengths(chunk, grid, n=size.kl_prompts, max_len=size.kl_max_len), vocab_size=vocab, seed=SEEDS["logprobs"])
    rec = record_pd_logprobs(pd.router, base.client, prompts, new_tokens=size.kl_new_tokens, top_k=size.top_k, vocab_size=vocab)
    probe_both(pd, "after pd_logprobs", requests=len(prompts), gauges=_gauges(pd))
    th = cell.model.thresholds
    kl = kl_verdict(rec, chunk=chunk, track_interval=grid, k3_max=th.kl_k3_max, floor_factor=th.kl_floor_factor, abs_cap=th.kl_abs_cap,
                    hit_fraction_min=th.hit_fraction_min, exact=exact_mode(pd), noise_factor=NOISE_FACTOR)
    settle(record_verdict(disagg_verdict([kl], transfer=transport(pd.spec))))


def test_pd_gsm8k(cell, request, record_verdict, cell_store):
    pd, base = _bind(cell, request, record_verdict)
    gsm8k_data = request.getfixturevalue("gsm8k_data")  # after the n/a check: a lazy cell needs no data
    size = sizes_for(pd)
    items = pick_items(gsm8k_data, size.gsm8k_n)

    def lm_eval_on(server):  # lm-eval's SGLang /generate adapter: the router speaks SGLang's native API
        return LmEvalGSM8K.for_server(gsm8k_data, server.base_url, server.info or base.info, api="sglang-generate",
                                      task_dir=cell_store.root / "lm_eval_tasks", shots=size.gsm8k_shots,
                                      max_gen_toks=size.gsm8k_new_tokens, concurrency=1 if exact_mode(pd) else 32)

    pd.router.flush_cache()
    served = lm_eval_on(pd).record(items, label=f"{cell.id} PD")
    probe_both(pd, "after pd_gsm8k", requests=len(items), gauges=_gauges(pd))
    base.client.flush_cache()
    baseline = lm_eval_on(base).record(items, label=f"{cell.id} non-PD")
    base.client.flush_cache()
    if exact_mode(pd):  # CPU twins: accuracy means nothing, every answer must equal the non-PD one
        verdict = disagg_verdict([gsm8k_verdict(served, mode="agreement", baseline=baseline)], transfer=transport(pd.spec))
    else:
        correct = sum(is_correct(a, "flexible") for a in served.answers)
        v = gsm8k_verdict(served, mode="accuracy", baseline=baseline, min_accuracy=cell.model.thresholds.gsm8k_min_accuracy)
        verdict = disagg_verdict([v], history=threshold_history(correct, len(served.answers)), transfer=transport(pd.spec))
    settle(record_verdict(verdict))


def test_pd_leaks(cell, request, record_verdict):
    pd, base = _bind(cell, request, record_verdict)
    size = sizes_for(pd)
    chunk, _grid = grids(cell)
    prompts = token_prompts([chunk + 1 + 7 * i for i in range(size.load_requests)], vocab_size=vocab_size(base), seed=SEEDS["load"])
    gauges = (*OCCUPANCY_GAUGES, KIT_MAMBA_USED_PEAK)  # a short PD decode can finish between SGLang's own gauge samples
    timeline, _out = sample_occupancy(pd.decode, lambda: generate_tokens(pd.router, prompts, size.load_new_tokens), gauges=gauges)
    probes = list(pd.extra.get("idle_probes", [])) + probe_both(pd, "after load", requests=len(prompts), gauges=_gauges(pd))
    logs = "\n".join(pd.log_texts().values())
    verdict = leak_verdict(probes, log_text=logs, alive=pd.alive(), timeline=timeline, gauges=_gauges(pd))
    settle(record_verdict(disagg_verdict([verdict], transfer=transport(pd.spec))))


def test_pd_transfer_failures(cell, request, record_verdict):
    prob = cell.env.get(DISAGG_FAILURE_ENV)
    reason = _pd_refusal(cell, request) or (None if prob else f"not applicable: the cell injects no transfer failure ({DISAGG_FAILURE_ENV})")
    if reason:
        settle(record_verdict(Verdict(CHECK, "skip", reason=reason)))
    pd = request.getfixturevalue("pd_endpoint")  # the non-PD server is not needed: nothing is compared with it
    size = sizes_for(pd)
    chunk, _grid = grids(cell)
    prompts = token_prompts([chunk + 1 + 7 * i for i in range(TRANSFER_FAILURE_REQUESTS + 1)], vocab_size=vocab_size(pd), seed=SEEDS["transfer_failures"])
    gauges = (*OCCUPANCY_GAUGES, KIT_MAMBA_USED_PEAK)
    timeline, rec = sample_occupancy(pd.decode, lambda: record_transfer_failures(
        pd.router, prompts[:-1], new_tokens=size.load_new_tokens, failure_prob=float(prob), follow_up_prompt=prompts[-1]),
        gauges=gauges, max_s=TRANSFER_FAILURE_LOAD_S)
    probes = probe_both(pd, "after transfer failures", requests=len(rec.outcomes) + len(rec.follow_up), gauges=_gauges(pd))
    logs = "\n".join(pd.log_texts().values())
    leaks = leak_verdict(probes, log_text=logs, alive=pd.alive(), timeline=timeline, gauges=_gauges(pd))
    settle(record_verdict(disagg_verdict([transfer_failure_verdict(rec), leaks], transfer=transport(pd.spec))))
