"""The mamba radix-cache strategies of SGLang 0.5.23 as records that carry their contract.

:data:`STRATEGIES` is the one registry: ``no_buffer``, ``extra_buffer`` and
``extra_buffer_lazy`` with what SGLang allows them (overlap scheduling, PD, page sizes) and
what a running request holds under each (ping-pong track slots).  The matrix loads its
``[strategies.*]`` tables over these records; the checks, the reference engine and the
targets ask a record's properties instead of comparing strategy names, so only this module
knows which name is which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from conformance.errors import KitError


@dataclass(frozen=True)
class Strategy:
    """One ``--mamba-radix-cache-strategy`` value and its contract.

    ``ping_pong_slots``: track slots a running request holds besides its working slot
    (``extra_buffer_lazy``: the one it always holds; a second only across a track boundary).
    ``overlap`` / ``pd``: SGLang allows the overlap scheduler / PD disaggregation with it.
    ``max_page_size``: the largest page size SGLang accepts (None: any).
    ``lazy``: the second track slot is taken lazily; ``eager_sibling`` names the strategy whose
    resident slots the lazy claim ("about half") is measured against.
    """

    name: str
    description: str
    overlap: bool
    ping_pong_slots: int
    pd: bool
    max_page_size: int | None = None
    lazy: bool = False
    eager_sibling: str | None = None

    # ------------------------------------------------------------ properties
    @property
    def has_buffer(self) -> bool:
        """Requests track their state in ping-pong slots (prefill checkpoints on the chunk
        grid, decode tracks on the track grid); without a buffer only the finish is stored."""
        return self.ping_pong_slots > 0

    @property
    def is_baseline(self) -> bool:
        """The strategy every other cell is paired with (GSM8K, agreement, perf ratios)."""
        return self.name == BASELINE

    @property
    def peak_track_slots(self) -> int:
        """The most track slots one running request can hold in a step (lazy: +1 across a
        track boundary)."""
        return self.ping_pong_slots + int(self.lazy)

    @property
    def mamba_slots_per_request(self) -> int:
        """Mamba slots a running request can hold at once: its working slot plus its peak of
        track slots."""
        return 1 + self.peak_track_slots

    @property
    def eager(self) -> Strategy:
        """The strategy the lazy claim is measured against (the record itself when it has no
        eager sibling)."""
        return STRATEGIES[self.eager_sibling] if self.eager_sibling else self

    def resident_track_slots(self, *, overlap: bool) -> int:
        """Track slots a running request holds at every decode step (SGLang's
        ``get_mamba_tracking_slots``): both ping-pong slots with the overlap scheduler on, one
        with it off; a lazy request always holds its one."""
        return min(self.ping_pong_slots, 1 + int(overlap))

    # ------------------------------------------------------------ what SGLang refuses
    def refuses_page_size(self, page_size: int) -> str | None:
        """Why SGLang refuses this strategy with ``page_size`` (None: it accepts it)."""
        m = self.max_page_size
        if m is None or page_size <= m:
            return None
        return f"SGLang refuses {self.name} with page size {page_size} ({self.name} requires --page-size {m} or less; largest page size {m})"

    def refuses_track_interval(self, track_interval: int, page_size: int) -> str | None:
        """Why SGLang refuses this track interval with ``page_size`` (None: it accepts it):
        buffered strategies track on page boundaries."""
        if not self.has_buffer or track_interval % page_size == 0:
            return None
        return f"SGLang requires mamba_track_interval % page_size == 0 ({track_interval} % {page_size} != 0)"

    def refuses_settings(self, *, overlap: bool, pd: bool) -> str | None:
        """Why SGLang refuses a matrix entry declaring this strategy with ``overlap`` / ``pd``
        that its contract does not allow (None: the entry is within the contract)."""
        if overlap and not self.overlap:
            return f"SGLang refuses {self.name} with overlap scheduling (overlap must be false)"
        if pd and not self.pd:
            return f"SGLang 0.5.23 refuses {self.name} under PD disaggregation (pd must be false)"
        return None

    def server_args(self) -> list[str]:
        """Scheduler arguments SGLang needs besides the strategy flag."""
        return [] if self.overlap else [DISABLE_OVERLAP_FLAG]


#: SGLang's flag that turns the overlap scheduler off (the overlap axis of ``conformance.matrix.axes``).
DISABLE_OVERLAP_FLAG = "--disable-overlap-schedule"
#: The name of the strategy every cell is paired with.
BASELINE = "no_buffer"

STRATEGIES: Mapping[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("no_buffer", "no extra slots; needs --disable-overlap-schedule and page size 1",
                 overlap=False, ping_pong_slots=0, pd=True, max_page_size=1),
        Strategy("extra_buffer", "2 ping-pong track slots per running request; overlap and larger pages allowed",
                 overlap=True, ping_pong_slots=2, pd=True),
        Strategy("extra_buffer_lazy", "1 track slot, the second taken only across a track boundary; refused under PD in 0.5.23",
                 overlap=True, ping_pong_slots=1, pd=False, lazy=True, eager_sibling="extra_buffer"),
    )
}
NAMES: tuple[str, ...] = tuple(STRATEGIES)
BUFFERED: tuple[str, ...] = tuple(n for n, s in STRATEGIES.items() if s.has_buffer)
LAZY: tuple[str, ...] = tuple(n for n, s in STRATEGIES.items() if s.lazy)


def strategy_named(name: str | Strategy) -> Strategy:
    """The registry's record for ``name`` (a record is returned as it is); KitError naming
    the allowed values for an unknown one."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KitError(f"unknown strategy {name!r}; choose one of {', '.join(NAMES)}") from None
