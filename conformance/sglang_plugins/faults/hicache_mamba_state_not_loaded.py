"""``hicache_mamba_state_not_loaded``: a prefix reloaded from the host tier gets its KV but
not its mamba state.

Hooks SGLang's ``MambaPoolHost.load_to_device_per_layer`` (AROUND): the host -> device copy
of the mamba (conv + temporal) state is skipped, so the device slot SGLang allocated for
the reloaded node keeps whatever it held before, while the radix tree treats it as the
prefix's state (the class of PR 27256: the hybrid host path's mamba call sites left stale
when the allocator was split).
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "hicache_mamba_state_not_loaded"
TARGET = "sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost.load_to_device_per_layer"


def skip_load(original, pool, *args, **kwargs):
    host_indices = plan_arg(args, kwargs, 1, "host_indices")
    if host_indices is not None and host_indices.numel():
        fired(NAME, states=int(host_indices.numel()), layer=plan_arg(args, kwargs, 3, "layer_id"))
        return None
    return original(pool, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "HiCache: a prefix loaded back from host memory gets its KV pages but not its mamba "
    "state (the host -> device copy of the conv and temporal state is skipped).",
    "SGLang PR 27256 class (the hybrid host path's mamba load left stale by the allocator split)",
    "the request continues from a stale device slot: answers on host-tier hits differ from cold (hicache)",
    (Hook(TARGET, "around", skip_load),),
    suites=("hicache",),
    cache_variant="hicache",
    group="hicache",
)
