"""The HiCache host-tier workload: prefixes stored, pushed out of the device tier by
pressure, then served again so SGLang loads them back from host memory.

1. flush; warm each prompt (``max_new_tokens=0``); what each stores is the prefix oracle's
   (``checks.prefix_oracle``: on ``extra_buffer`` the prefill checkpoint on the chunk grid);
2. pressure: distinct prompts, more requests than the mamba pool has slots and more tokens
   than the device KV pool holds, but (with the prompts) less than the host tier holds, so
   the device tier evicts the warmed prefixes and the host tier (SGLang backs up on insert,
   ``write_through``) keeps them;
3. serve each prompt extended by a few tokens: a prefix hit that SGLang reports per tier
   (``meta_info.cached_tokens_details``: ``device``, ``host``);
4. the cold half of a KL recording (``runners.judge_against_cold``) on the flushed server.

Every request is greedy and bounded by the client's timeout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.recordings import HostReloadRecording
from conformance.workloads.prompts import extension, token_prompts
from conformance.workloads.runners import cache_enabled, generate_tokens, judge_against_cold

#: Pressure prompts are sent in batches of this many (the scheduler admits what fits).
PRESSURE_BATCH = 8


@dataclass(frozen=True)
class HostTierSizes:
    """The device tier the pressure must overflow and the host tier it must fit in."""

    device_tokens: int
    device_states: int
    host_ratio: float

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> "HostTierSizes":
        try:
            return cls(int(info["max_total_num_tokens"] if "max_total_num_tokens" in info else info["max_total_tokens"]),
                       int(info["max_mamba_cache_size"]), float(info.get("hicache_ratio") or 0))
        except (KeyError, TypeError, ValueError) as e:
            raise KitError(f"hicache: /server_info lacks the pool sizes the host-tier workload is sized from ({e})") from None

    def pressure(self, stored_tokens: int, *, length: int = 160) -> tuple[int, int]:
        """(count, length) of the pressure prompts: past the device pools, inside the host tier."""
        count = max(self.device_states + 12, math.ceil(1.25 * self.device_tokens / length))
        host_tokens = self.host_ratio * self.device_tokens
        if count * (length + 1) + stored_tokens >= host_tokens or count >= self.host_ratio * self.device_states:
            raise KitError(
                f"hicache: the host tier ({host_tokens:.0f} tokens, {self.host_ratio * self.device_states:.0f} states) cannot "
                f"hold the pressure ({count} x {length} tokens) needed to overflow the device tier ({self.device_tokens} tokens, {self.device_states} states)"
            )
        return count, length


def tier_tokens(resp: dict[str, Any]) -> tuple[int, int]:
    """(device, host) cached tokens of one response (SGLang's ``cached_tokens_details``)."""
    details = resp["meta_info"].get("cached_tokens_details") or {}
    if not isinstance(details, dict):
        return 0, 0
    return int(details.get("device") or 0), int(details.get("host") or 0)


def record_host_reload(
    client: SGLangClient,
    prompts: Sequence[Sequence[int]],
    sizes: HostTierSizes,
    oracle: PrefixOracle,
    *,
    vocab_size: int,
    chunked_prefill_size: int | None = None,
    new_tokens: int = 8,
    top_k: int = 5,
    ext_len: int = 8,
    seed: int = 31,
    timeout: float | None = None,
) -> HostReloadRecording:
    enabled = cache_enabled(client)
    client.flush_cache()
    oracle.flush()
    for p in prompts:  # one by one: each prefill stores its own checkpoint
        generate_tokens(client, [p], 0, timeout=timeout)
        oracle.record_request(p, (), chunked_prefill_size=chunked_prefill_size)
    count, length = sizes.pressure(sum(len(p) for p in prompts))
    pressure = token_prompts([length] * count, vocab_size=vocab_size, seed=seed)
    for i in range(0, count, PRESSURE_BATCH):
        generate_tokens(client, pressure[i:i + PRESSURE_BATCH], 1, timeout=timeout)
    inputs = [tuple(p) + extension(ext_len, vocab_size=vocab_size, seed=f"hicache:{i}") for i, p in enumerate(prompts)]
    stored = tuple(oracle.expected_hit(inp) for inp in inputs)
    served = []
    for inp in inputs:  # one by one: each hit is loaded on its own
        served += generate_tokens(client, [inp], new_tokens, top_k=top_k, timeout=timeout)
    tiers = [tier_tokens(r) for r in served]
    kl = judge_against_cold(served, inputs, client, scenario="prefill_hit", enabled=enabled, new_tokens=new_tokens, top_k=top_k, timeout=timeout)
    return HostReloadRecording(stored, tuple(d for d, _ in tiers), tuple(h for _, h in tiers), kl, (count, length))
