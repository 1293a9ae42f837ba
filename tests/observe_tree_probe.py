"""Run inside an SGLang release's venv (``python tests/observe_tree_probe.py TREE REQUESTS``,
``PYTHONPATH`` = the kit): the observe plugin's per-node hooks on that release's real radix tree.

Registers the release's per-node hooks (``observe.register_state_hooks``) through SGLang's own
hook registry, builds the tree ``TREE`` (``MambaRadixCache`` or ``UnifiedRadixCache``) on the
pool tier's small real pools (``conformance.sglang_api``'s legacy driver), and drives it with
no model: insert a 64-token prefix A, its 96-token extension B, A again (the state is there: no
record), then a walk asked for one mamba state, then a reset.  The evidence lands in
``REQUESTS`` (the file a server's plugin writes); stdout is one JSON line with what the
tree itself held, for the test to compare with the records.  ``--drop ATTR`` deletes
``TREE.ATTR`` before the hooks are planned (a release without that piece).
"""

from __future__ import annotations

import argparse
import json
import os
from array import array

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", choices=("MambaRadixCache", "UnifiedRadixCache"))
    ap.add_argument("requests")
    ap.add_argument("--drop", default=None)
    args = ap.parse_args()

    from conformance.sglang_plugins.activation import REPORT_ENV

    os.environ[REPORT_ENV] = args.requests.removesuffix(".requests.jsonl") + ".plugins.jsonl"
    import importlib

    module = importlib.import_module("sglang.srt.mem_cache." + {"MambaRadixCache": "mamba_radix_cache",
                                                               "UnifiedRadixCache": "unified_radix_cache"}[args.tree])
    tree_cls = getattr(module, args.tree)
    if args.drop:
        for k in tree_cls.__mro__:
            if args.drop in vars(k):
                delattr(k, args.drop)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from conformance.sglang_plugins import observe

    start_line = observe.register_state_hooks(HookRegistry, HookType.AROUND)
    HookRegistry.apply_hooks()
    hooked = start_line()
    if args.drop:  # the start line is the point: no per-node hooks, so no records to drive
        print(json.dumps({"hooked": hooked}))
        return

    from conformance.sglang_api import pool
    from conformance.sglang_api.pool_driver import PoolSizes
    from conformance.sglang_api.pool_legacy import _kwargs_for
    from conformance.sglang_api.pool_runtime import PoolKey

    api = pool.load()
    driver = api.driver(PoolKey("no_buffer", 1, 256, 64), PoolSizes(mamba_slots=8, kv_tokens=512), api=api)
    rtp, alloc = driver.rtp, driver.alloc
    if args.tree == "MambaRadixCache":
        tree = driver.tree
    else:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_radix_cache import ComponentType

        tree = tree_cls(CacheInitParams(**_kwargs_for(
            CacheInitParams, disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA), tree_core_backend="python")))
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots_owner = getattr(rtp, "mamba_allocator", None) or rtp.mamba_pool

    def insert(tokens: list[int]) -> tuple[int, bool]:
        slot = slots_owner.alloc(1)
        kv = alloc.alloc(len(tokens))
        result = tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=kv.to(torch.int64), mamba_value=slot))
        if result.mamba_exist:
            slots_owner.free(slot)
        return int(slot.view(-1)[0]), bool(result.mamba_exist)

    def held() -> list[int]:
        return sorted(int(s) for s in tree.all_mamba_values_flatten().reshape(-1).tolist())

    a, b = list(range(1, 65)), list(range(1, 97))
    slot_a, exist_a = insert(a)
    slot_b, exist_b = insert(b)
    _, exist_again = insert(a)  # the state of A is there: the tree takes nothing
    held_before = held()
    result = tree.evict(EvictParams(num_tokens=0, mamba_num=1))
    held_after = held()
    tree_states_after_evict = dict(observe._TREE_STATES)
    tree.reset()
    print(json.dumps({
        "hooked": hooked, "slots": {"a": slot_a, "b": slot_b}, "exist": [exist_a, exist_b, exist_again],
        "held_before": held_before, "held_after": held_after, "mamba_evicted": int(result.mamba_num_evicted),
        "remembered_after_evict": sorted(tree_states_after_evict), "remembered_after_reset": sorted(observe._TREE_STATES),
    }))


if __name__ == "__main__":
    main()
