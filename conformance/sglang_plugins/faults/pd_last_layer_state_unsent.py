"""``pd_last_layer_state_unsent``: the last mamba layer's state is not sent to the decode side.

Hooks SGLang's Mooncake ``MooncakeKVManager._send_mamba_state`` (AROUND): the transfer
entries of the highest layer id (its conv and temporal state tensors) are dropped from
the source list, so the decode slot keeps whatever that layer's state held before.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "pd_last_layer_state_unsent"
TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_mamba_state"


def drop_last_layer(original, manager, req, prefill_mamba_index, src_ptrs, src_lens, dst_ptrs, dst_index,
                    src_layer_ids=None, *args, **kwargs):
    n = len(src_ptrs)
    if src_layer_ids:
        last = max(src_layer_ids)
        keep = [i for i, lid in enumerate(src_layer_ids) if lid != last]
        src_layer_ids = [src_layer_ids[i] for i in keep]
    else:  # no layer metadata: entries pair positionally, the last one is the last layer's
        keep = list(range(n - 1))
    if len(keep) < n:
        fired(NAME, entries=n - len(keep))
    return original(manager, req, prefill_mamba_index, [src_ptrs[i] for i in keep], [src_lens[i] for i in keep],
                    dst_ptrs, dst_index, src_layer_ids, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "PD: the last mamba layer's state (conv and temporal tensors) is not sent; the decode "
    "slot keeps that layer's previous contents.",
    "PD state transfer class (a layer missing from the transfer list)",
    "the decode side continues from a partly stale state: PD outputs differ from the non-PD server's (disagg KL)",
    (Hook(TARGET, "around", drop_last_layer),),
    strategies=("no_buffer",),
    suites=("disagg",),
    group="pd",
)
