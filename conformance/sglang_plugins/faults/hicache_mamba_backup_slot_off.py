"""``hicache_mamba_backup_slot_off``: the host tier stores another slot's mamba state.

Hooks SGLang's ``MambaPoolHost.backup_from_device_all_layer`` (AROUND): the device slots
whose state is written back to host memory are each shifted to the neighbouring slot
(index + 1, the last one - 1), as when a per-request index is taken from the wrong row of
a batch of write-backs.  The KV pages are backed up correctly; a prefix reloaded from the
host tier continues from another request's (or a free slot's) state.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "hicache_mamba_backup_slot_off"
TARGET = "sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost.backup_from_device_all_layer"


def backup_neighbour(original, pool, device_pool, host_indices, device_indices, *args, **kwargs):
    if device_indices is not None and device_indices.numel():
        size = int(pool.buffer_info.temporal.shape[1])
        shifted = device_indices + 1
        shifted[shifted >= size] -= 2
        fired(NAME, states=int(device_indices.numel()))
        device_indices = shifted
    return original(pool, device_pool, host_indices, device_indices, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "HiCache: the mamba state written back to host memory is the neighbouring device slot's "
    "(KV pages correct).",
    "per-request state index wrong in a batch of host write-backs (PR 15829 / PR 27256 classes)",
    "a prefix reloaded from the host tier continues from another state: answers on host-tier hits differ from cold (hicache)",
    (Hook(TARGET, "around", backup_neighbour),),
    suites=("hicache",),
    cache_variant="hicache",
    group="hicache",
)
