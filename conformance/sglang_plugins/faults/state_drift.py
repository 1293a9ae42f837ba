"""``state_drift``: the copy-on-write of a matched mamba state scales the first recurrent
layer's SSM state by 0.99 -- a subtle precision bug in a state copy.

Hooks SGLang's ``HybridReqToTokenPool.copy_mamba_state`` (AFTER), which the model runner
calls for the copy-on-write of cache hits only.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "state_drift"
TARGET = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool.copy_mamba_state"
SCALE = 0.99


def drift(result, pool, src_index, dst_index, *args, **kwargs):
    import torch

    if dst_index.numel() == 0:
        return result
    first_layer = pool.mamba_pool.mamba_cache.temporal[0]
    rows = dst_index.reshape(-1).to(device=first_layer.device, dtype=torch.long)
    first_layer[rows] = first_layer[rows] * SCALE
    fired(NAME, slots=int(rows.numel()))
    return result


FAULT = sglang_fault(
    NAME,
    f"On a cache hit the copied SSM state of the first recurrent layer is scaled by {SCALE}: a "
    "small drift on hits only, which greedy tokens may hide but logprobs do not.",
    "a precision bug in the mamba state copy (e.g. a dtype round trip)",
    "small logprob drift on hits only: top-k KL and SGLang's k3 estimator against a cold run",
    (Hook(TARGET, "after", drift),),
)
