"""What a finished request that reasoned stores on a ``--strip-thinking-cache`` server
(SGLang 0.5.23, #22373), for the programs' hit oracle.

A request counts thinking when it asks for reasoning (``require_reasoning``: with the qwen3
parser every output token before the think-end ids is thinking; the kit's twins never emit
them).  Its finish is then keyed by its prompt only (``Req.owned_kv_len``), page-floored; the
output's KV is freed.  The Mamba state under that key:

- a buffered strategy (extra_buffer, lazy) gives the newest tracked state at or below the key
  (``MambaComponent._select_finished_checkpoint``): every decode track lies past the prompt,
  so it is the older ping-pong state (the prefill checkpoint, already a prefill store) or
  nothing -- no new finish store;
- no_buffer offers the request's live state (``prepare_for_caching_req``: ``cache_len =
  token_ids_len``), which has read the output, under the prompt key -- but the prefill's own
  insert already stored the prompt's state at exactly that key, so the tree keeps that one
  (``mamba_exist``: measured on 0.5.23, the KL ``decode_hit`` of the no_buffer strip-thinking
  cell hits the whole prompt and matches cold).  The key is what the hit oracle needs; whether
  the state under it is right is the outputs' check.
"""

from __future__ import annotations

from typing import Any, Mapping

from conformance.checks.hit_bounds import Key, Prefix, StrategyGrid, finish_store, possible_finish_stores
from conformance.checks.prefix_oracle import floor_to

#: The request field that asks for reasoning (the programs' payload key).
REASONING_FIELD = "require_reasoning"


def reasoned(options: Mapping[str, Any]) -> bool:
    """Did the request ask for reasoning (so that, on a strip-thinking server, only its prompt is kept)?"""
    return bool(options.get(REASONING_FIELD))


def reasoning_finish_store(prompt: Key, grid: StrategyGrid) -> Key | None:
    """The state a finished reasoning request inserts (None: no new one)."""
    n = floor_to(len(prompt), grid.page_size)
    if grid.buffered or n <= 0:
        return None
    return Prefix(prompt[:n])


def finish_store_of(prompt: Key, output: Key, grid: StrategyGrid, options: Mapping[str, Any],
                    untracked: frozenset[int] = frozenset()) -> Key | None:
    """:func:`conformance.checks.hit_bounds.finish_store`, or for a reasoning request :func:`reasoning_finish_store`."""
    return reasoning_finish_store(prompt, grid) if reasoned(options) else finish_store(prompt, output, grid, untracked)


def possible_finish_stores_of(prompt: Key, output: Key, grid: StrategyGrid, options: Mapping[str, Any]) -> set[Key]:
    """:func:`conformance.checks.hit_bounds.possible_finish_stores`; a reasoning request's irregular finish is
    keyed by its prompt as well."""
    if reasoned(options):
        key = reasoning_finish_store(prompt, grid)
        return {key} if key else set()
    return possible_finish_stores(prompt, output, grid)
