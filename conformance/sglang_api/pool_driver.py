"""The pool tier's driver contract: what every SGLang-facing pool driver offers.

A driver (``conformance.sglang_api.pool_kv.KvPoolDriver`` for the ``req.kv`` lifecycle,
``conformance.sglang_api.pool_legacy.LegacyPoolDriver`` for the older one with the cache
state on the ``Req``) builds SGLang's real pools and radix tree for one
:class:`~conformance.sglang_api.pool_runtime.PoolKey` and drives requests through SGLang's
own lifecycle functions; it is built as ``Driver(key, sizes, api=api)`` with the namespace
``conformance.sglang_api.pool.load()`` returns (what both drivers share is in
``pool_base``).  Scenarios, the state machine and the invariants (``conformance.targets.pool``)
talk to it only through the names below, so they run unchanged on every release a driver fits.

Operations: ``admit``, ``adopt``, ``prefill_chunk``, ``decode``, ``finish``, ``evict``,
``evict_all``, ``flush``, ``activate``, ``fresh_token``, ``reuse(req, prompt)`` (a finished Req
carried into the next turn, as streaming sessions do).  Views: ``state(req)`` (the object
holding the request's cache fields), ``free_mamba_slots()``, ``tree_mamba_slots()``,
``tree_state_keys()``, ``mamba_available()``, ``request_slots(req)``, ``session_records()``,
``live_state_len(run)`` (how many tokens the request's live slot state covers; None before a
prefill that will copy or clear it).  Attributes:
``key``, ``sizes``, ``api``, ``rtp``, ``alloc``, ``tree``, ``extra``, ``lazy``, ``chunk``,
``checkpoint_grid``, ``track_grid``, ``running``, ``evictions``, and the capability
answers ``oracle_exact`` (the prefix oracle models this lifecycle's insert points),
``sglang_checker`` (SGLang's own idle invariant checker can be wired) and the classmethod
``gap(api, key, need)`` (None, or the one line saying why the release and driver cannot run
``key``, or a scenario needing ``sessions`` or ``lookahead``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAMBA_LAYERS = (0, 1, 2)
FULL_LAYERS = (3,)


class StateMismatch(AssertionError):
    """A slot did not hold the state the request's bookkeeping says it holds."""


class PoolExhausted(Exception):
    """The pools cannot take this operation now (the scheduler would not schedule it)."""


class NotApplicable(Exception):
    """The installed SGLang (or the driver that fits it) cannot do what was asked; one line."""


@dataclass(frozen=True)
class PoolSizes:
    mamba_slots: int = 12
    max_reqs: int = 3
    kv_tokens: int = 2048
    max_context_len: int = 2048


@dataclass
class Running:
    """A request the driver runs: the real ``Req`` plus what the kit knows of it."""

    rid: str
    req: object
    prompt: tuple[int, ...]
    matched: int
    chunked_prefill_size: int | None
    prefill_done: bool = False
    stored: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return list(self.req.origin_input_ids) + list(self.req.output_ids)
