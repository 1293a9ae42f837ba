"""``child_under_wrong_key``: a radix node sits in its parent's children under a key that is
not its own first page, as a split that re-keyed the wrong child would leave it.

Hooks SGLang's ``UnifiedRadixCache.match_prefix`` (AFTER; the tree's insert is the observe
plugin's, whose per-node records prove their hooks by that symbol): at the first match that
finds the Python tree core's root with a child (the request after the first insert), that child is moved in ``root.children`` from its own
child key to one no token sequence has; nothing else changes.  SGLang's own ``sanity_check``
checks parent pointers, leaf sets, LRU lists and sizes, not the key a child is filed under,
so it passes; the harm is delayed or absent: a later request on that prefix matches nothing
there (a lower hit, the same answer), and evicting the node later fails to find it.
Python tree core only (``tree_core=python``): the Rust core keeps its nodes out of reach.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "child_under_wrong_key"
TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix"
_DONE: list[int] = []


def misfile_child(result, cache, *args, **kwargs):
    try:
        root = cache.tree_core.root_node  # the Rust core raises NotImplementedError: never fires there
    except (AttributeError, NotImplementedError):
        return result
    if _DONE or not root.children:
        return result
    key, node = next(iter(root.children.items()))
    del root.children[key]
    root.children[("misfiled", node.id)] = node  # a key no page of tokens is
    _DONE.append(node.id)
    fired(NAME, node=node.id, tokens=len(node.key))
    return result


FAULT = sglang_fault(
    NAME,
    "After the first insert (at the next match), the root's first child is filed under a key that is not its own "
    "first page: SGLang's own sanity check passes; a later request on that prefix misses it "
    "(a lower hit, same answer) and evicting it later fails.",
    "tree structure: a split or insert that files a child under the wrong first-page key",
    "tree audit: child_key at the node's path (SGLang's own sanity check does not see it)",
    (Hook(TARGET, "after", misfile_child),),
    suites=("programs",),
    options=("tree_core=python",),
    group="programs",
)
