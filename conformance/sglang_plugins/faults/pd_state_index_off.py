"""``pd_state_index_off``: the prefill side ships the mamba state of the wrong slot.

Hooks SGLang's Mooncake ``MooncakeKVManager._send_mamba_state`` (AROUND): the source slot
of the request's state is its neighbour (index - 1; + 1 for slot 0), as when a
per-sequence index is taken from the wrong position of a batch of transfers.  KV pages
are sent as usual; the decode side continues from another sequence's (or a free slot's)
recurrent state.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "pd_state_index_off"
TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_mamba_state"


def send_neighbour(original, manager, req, prefill_mamba_index, *args, **kwargs):
    idx = int(prefill_mamba_index[0])
    fired(NAME, slot=idx)
    return original(manager, req, [idx - 1 if idx > 0 else idx + 1], *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "PD: the prefill server sends the mamba state of the neighbouring slot instead of the "
    "request's own (KV pages correct).",
    "SGLang PR 15829 (per-sequence mamba state index wrong in a batch of PD transfers; reverted)",
    "the decode side continues from another state: PD tokens and logprobs differ from the non-PD server's (disagg KL)",
    (Hook(TARGET, "around", send_neighbour),),
    strategies=("no_buffer",),
    suites=("disagg",),
    group="pd",
)
