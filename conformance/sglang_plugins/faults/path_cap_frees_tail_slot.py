"""``path_cap_frees_tail_slot``: the per-path cap's walk releases the slot of the state it was
asked to keep.

With ``--mamba-max-states-per-path N`` SGLang (0.5.18+) follows each new Mamba state's
insert with a cap step (``MambaEvictExcessPathStates``, run by
``MambaComponent.apply_component_action``; on 0.5.23 the walk itself runs in the Rust tree
core): it tombstones the shallowest interior states beyond N on the new tail's path and
keeps the tail, forks and locked nodes.  This fault hooks ``apply_component_action``
(AROUND): after SGLang's cap step it also returns the tail's slot to the allocator while
the tail node keeps naming it -- a walk whose stop condition let the tail count among the
excess, releasing its slot without detaching it.  The slot is then counted both free and
cached (at idle SGLang's strict check and the kit's idle invariant see it), it is freed a
second time when the node goes, and once the allocator reaches it a running request's state
overwrites it under later hits on the tail's prefix.  (The allocator hands slots out first-in
first-out, so on the default 48-slot pool that last takes a workload that cycles the pool:
the direct probe's hits were measured equal to cold.)  SGLang emits the cap step only when
the cap is set, so the fault shows only on ``path_cap = 1`` cells.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "path_cap_frees_tail_slot"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.apply_component_action"
_FREED: set[int] = set()


def free_tail_after_cap_step(original, component, *args, **kwargs):
    out = original(component, *args, **kwargs)
    action = plan_arg(args, kwargs, 0, "action")
    if type(action).__name__ != "MambaEvictExcessPathStates":
        return out
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    value = component.tree_core.get_component_device_value(action.tail_node_id, ComponentType.MAMBA)
    if value is None:
        return out
    slot = int(value.reshape(-1)[0])
    if slot in _FREED:
        return out
    _FREED.add(slot)
    component.cache.req_to_token_pool.mamba_allocator.free(value.reshape(-1).clone())
    fired(NAME, slot=slot, tail=str(action.tail_node_id))
    return out


FAULT = sglang_fault(
    NAME,
    "After each insert's per-path cap step (--mamba-max-states-per-path), the slot of the new tail "
    "state -- the one the cap must keep -- is returned to the allocator while the tail node still "
    "names it: the slot is counted free and cached, is freed again when the node goes, and once the "
    "allocator hands it out another request's state overwrites it under later hits on that prefix.",
    "the per-path cap walk (MambaComponent._evict_excess_path_states / the Rust core's) counting the "
    "tail among the excess and releasing its slot without detaching it",
    "a slot counted twice at idle (SGLang's strict idle check; with it off, the leaks suite's idle "
    "invariant: mamba used below 0); hits diverge only after the allocator has cycled to the slot; only "
    "with the cap set",
    (Hook(TARGET, "around", free_tail_after_cap_step),),
    options=("path_cap=1",),
    suites=("leaks", "kl", "prefix_branching"),
    group="option",
)
