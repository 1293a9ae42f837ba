"""``mixed_chunk_track_dropped``: in a mixed batch (``--enable-mixed-chunk``: a prefill chunk
batched with running decodes) the prefill rows' mamba tracking is dropped from the batch
while the requests keep their track slots and checkpoint lengths.

SGLang's ``ScheduleBatch.mix_with_running`` says why it re-attaches the prefill rows'
tracking after ``merge_batch``: "merge_batch drops the Mamba track fields, but
checkpoint_kv_cache still donates each prefill row's track slot after this forward".  This
fault hooks ``mix_with_running`` (AFTER) and drops that tracking again (the device
``mamba_track_mask`` and the host ``mamba_prefill_track_mask_cpu`` the forward selects the
tracked rows from): the forward never writes the checkpoint state into the track slot, and
the checkpoint is still donated to the radix cache -- a checkpoint claimed but not written.
Only a server with ``--enable-mixed-chunk`` ever calls ``mix_with_running``: with the
option off the fault cannot fire.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, sglang_fault, zero_device_track_mask

NAME = "mixed_chunk_track_dropped"
TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running"


def drop_prefill_tracking(result, batch, *args, **kwargs):
    marks = getattr(batch, "mamba_prefill_track_mask_cpu", None)
    if marks and any(marks):
        zero_device_track_mask(NAME, batch, "mamba_prefill_track_mask_cpu")
        # the forward selects the tracked prefill rows from this host list: drop them there too
        batch.mamba_prefill_track_mask_cpu = [False] * len(marks)
    return result


FAULT = sglang_fault(
    NAME,
    "In a mixed prefill+decode batch (--enable-mixed-chunk) the prefill rows' mamba tracking is "
    "dropped from the batch while the requests keep their checkpoints: the checkpoint state is never "
    "written into the track slot, and the stale slot is still donated to the radix cache.",
    "the case SGLang's ScheduleBatch.mix_with_running guards (merge_batch drops the mamba track fields "
    "while checkpoint_kv_cache still donates each prefill row's track slot)",
    "a hit on a prefix checkpointed in a mixed batch continues from a stale state (KL / outputs on hit vs cold); "
    "with --enable-mixed-chunk off the hook never fires",
    (Hook(TARGET, "after", drop_prefill_tracking),),
    options=("mixed_chunk=on",),
    suites=("kl", "prefix_branching"),
    group="option",
)
