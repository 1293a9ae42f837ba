"""KL suite: prefill-hit and decode-hit logprobs against cold re-prefills, per cell.

Record (served on a cache hit, then two cold re-prefills for the noise floor), check
(``checks.kl.kl_verdict``: SGLang's chosen-token estimator, true top-k KL, per-sequence
maxima, per-position curve), settle.
"""

from __future__ import annotations

import uuid

import pytest

from conformance.matrix import axes
from conformance.checks.kl import NOISE_FACTOR, kl_verdict
from conformance.programs.evidence import owed_hits
from conformance.recordings import KLRecording
from conformance.session.suite_support import exact_mode, grids, lookahead, no_prefill_stores, oracle_for, settle, sizes_for, vocab_size
from conformance.workloads.prompts import decode_cross_lengths, multi_boundary_decode, prefill_hit_lengths, token_prompts
from conformance.workloads.runners import KL_EXT_LEN, record_kl

pytestmark = pytest.mark.kl
SEEDS = {"prefill_hit": 11, "decode_hit": 12}


@pytest.mark.parametrize("scenario", ["prefill_hit", "decode_hit"])
def test_kl(endpoint, scenario, record_verdict):
    cell = endpoint.cell
    size = sizes_for(endpoint)
    chunk, grid = grids(cell)
    if scenario == "prefill_hit" and (why := no_prefill_stores(endpoint)):
        pytest.skip(why)
    if scenario == "prefill_hit":
        lengths = prefill_hit_lengths(chunk, grid, n=size.kl_prompts, max_len=size.kl_max_len)
        turn1: list[int] = []
    else:
        lengths = decode_cross_lengths(grid, size.kl_turn1_tokens, n=max(2, size.kl_prompts // 2), max_len=size.kl_max_len)
        turn1 = [size.kl_turn1_tokens] * len(lengths)
        if multi := multi_boundary_decode(grid, max_len=size.kl_max_len):  # the ping-pong slots alternate
            lengths.append(multi[0])
            turn1.append(multi[1])
    prompts = token_prompts(lengths, vocab_size=vocab_size(endpoint), seed=SEEDS[scenario])
    recording = record_kl(
        endpoint.client,
        prompts,
        scenario=scenario,
        new_tokens=size.kl_new_tokens,
        top_k=size.top_k,
        turn1_tokens=turn1 or size.kl_turn1_tokens,
        vocab_size=vocab_size(endpoint),
        # a mixed-chunk cell stores its prefill checkpoints from mixed batches (conformance.matrix.axes)
        mixed=axes.enabled(cell, axes.MIXED_BATCHES),
        # a strip-thinking cell caches only the prompt of a request that reasons (conformance.matrix.axes)
        reasoning=axes.enabled(cell, axes.REASONING_REQUESTS),
        rid_tag=f"kl-{scenario}-{uuid.uuid4().hex[:8]}",
    )
    # what SGLang's tree held for each served request when it admitted it (its per-node records)
    owed = list(owed_hits(endpoint.log_path, endpoint.target, cell.page_size,
                          [(str(i), s.input_ids, s.rid) for i, s in enumerate(recording.sequences)]).values())
    th = cell.model.thresholds
    verdict = kl_verdict(
        recording,
        chunk=chunk,
        track_interval=grid,
        k3_max=th.kl_k3_max,
        floor_factor=th.kl_floor_factor,
        abs_cap=th.kl_abs_cap,
        hit_fraction_min=th.hit_fraction_min,
        exact=exact_mode(endpoint),
        noise_factor=NOISE_FACTOR,
        owed=owed,
        # strip-thinking keeps a reasoning turn's states at or below its prompt only, maybe none
        may_store_nothing=scenario == "decode_hit" and axes.enabled(cell, axes.REASONING_REQUESTS),
        modelled=_modelled(endpoint, scenario, prompts, recording),
    )
    settle(record_verdict(verdict))



def _modelled(endpoint, scenario: str, prompts, recording: KLRecording) -> list[int]:
    """Per served sequence, the hit the storage rule owes it for sure: for ``decode_hit``, the
    state turn one's finish caches (its last decode track boundary; no_buffer: its whole
    sequence), the same whatever the prefill's chunks; 0 for ``prefill_hit`` (where SGLang
    checkpoints a prefill depends on how the batch's budget cut it, not modelled here) and
    where the served input does not extend its prompt."""
    out, ahead = [], lookahead(endpoint)
    for prompt, seq in zip(prompts, recording.sequences):
        prompt = tuple(prompt)
        if scenario != "decode_hit" or seq.input_ids[: len(prompt)] != prompt or len(seq.input_ids) < len(prompt) + KL_EXT_LEN:
            out.append(0)
            continue
        oracle = oracle_for(endpoint)
        oracle.record_finished(prompt, seq.input_ids[len(prompt): len(seq.input_ids) - KL_EXT_LEN], lookahead=ahead)
        out.append(oracle.expected_hit(seq.input_ids))
    return out
