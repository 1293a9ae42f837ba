"""Install pins per SGLang release range: what an older release needs over the kit's set-up.

Not feature detection (that is ``probes``): these are measured install requirements.
An older release imported with the kit's transformers fails with "'qwen3_asr' is already
used by a Transformers config"; measured working sets: transformers 5.6.0 for 0.5.11 and 0.5.12,
5.8.1 for 0.5.13, 5.12.1 for 0.5.18, the kit's own pin (ci/requirements-cpu.txt) from
0.5.22.  A release takes the row of the newest range start at or below it.

Stdlib only, so ``ci/setup-cpu.sh`` can run it before the kit is installed:
``python conformance/sglang_api/release_pins.py 0.5.13`` prints ``transformers==5.8.1``.
"""

from __future__ import annotations

import re
import sys

# first release of a range -> pins installed (with their dependencies) over the kit's set
# openai-harmony: the older releases' own Requires-Dist (0.0.4); their HTTP server imports it at
# start-up and logs a traceback without it, which the leaks suite's log scan reports.
HARMONY = "openai-harmony==0.0.4"
RANGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.5.11", ("transformers==5.6.0", HARMONY)),  # 0.5.11 and 0.5.12 (0.5.11's own Requires-Dist)
    ("0.5.13", ("transformers==5.8.1", HARMONY)),
    ("0.5.18", ("transformers==5.12.1", HARMONY)),
    ("0.5.22", ()),
)
OLDEST = RANGES[0][0]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:4])


def release_of(spec: str) -> str | None:
    """``0.5.13`` or ``sglang==0.5.13`` -> ``0.5.13``; a path or other spec -> None."""
    m = re.fullmatch(r"(?:sglang==)?(\d+(?:\.\d+){1,3}(?:\.post\d+)?)", spec.strip())
    return m.group(1) if m else None


def pins_for(version: str) -> tuple[str, ...]:
    """The extra pins ``version`` needs; ValueError for a release older than the range."""
    if _key(version) < _key(OLDEST):
        raise ValueError(f"sglang {version} is older than the oldest supported release {OLDEST}")
    chosen: tuple[str, ...] = ()
    for start, pins in RANGES:
        if _key(start) <= _key(version):
            chosen = pins
    return chosen


if __name__ == "__main__":
    try:
        print(" ".join(pins_for(sys.argv[1])))
    except (IndexError, ValueError) as e:
        print(f"release_pins: {e or 'usage: release_pins.py VERSION'}", file=sys.stderr)
        sys.exit(2)
