"""Whether a cell's server options apply to the installed SGLang, in SGLang's own words.

Three answers, each ``na``:

* before launch, the release's parser lacks a flag or a choice the cell's server-option axes
  (``conformance.matrix.axes``) pass (``conformance.sglang_api.probes``: the parser's own
  ``invalid choice`` / ``unrecognized`` line);
* at launch, SGLang refused the command while resolving its server arguments (a traceback
  through ``sglang/srt/arg_groups`` or ``server_args.py``, before any model loads): the
  exception's last line from the server log is the reason -- any refusal for a cell with
  option axes, only the refusal of the strategy for the model's architecture for a core cell;
* before launch, on the CPU target, the cell's strategy uses the extra buffer and the release
  gates it on the device with neither a platform answer nor an assert the CPU plugin answers
  (:func:`gate_refusal`: the missing capability is the reason);
* before launch, a start-up assert of the release the cell would reach after its model loads
  (:func:`start_refusal`, probed from SGLang's source: SGLang's own line): an extra-buffer track
  interval below the model's mamba chunk, a think-end token the served tokenizer splits.

Any other start failure stays a failure: a crash after the arguments resolved is not a
refusal.
"""

from __future__ import annotations

import re
from pathlib import Path

from conformance.matrix.axes import REASONING_REQUESTS, THINK_END_TOKEN, enabled, needed
from conformance.matrix.cells import Cell
from conformance.reference.twins import ensure_twin
from conformance.reference.tokenizer import TwinTokenizer
from conformance.sglang_api.validate import UNSUPPORTED_FOR_MODEL

#: Where SGLang resolves and validates its server arguments.
_RESOLUTION_FRAMES = re.compile(r'File "[^"]*sglang/srt/(arg_groups/[^"]+|server_args\.py)"')
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def probed_refusal(cell: Cell, features) -> str | None:
    """The parser's own line when the installed release lacks what the cell's options need."""
    if not cell.options:
        return None
    return features.option_not_applicable(needed(cell))


def gate_refusal(cell: Cell, features) -> str | None:
    """The missing capability when the cell's strategy uses the extra buffer and the release
    gates it on the device with nothing the CPU target can answer (``na`` before launch,
    instead of starting and dying on SGLang's device assert)."""
    return features.device_gate_not_applicable() if cell.strategy.has_buffer else None


def start_refusal(cell: Cell, features, *, twins: bool) -> str | None:
    """SGLang's own line for a start-up assert the release would stop ``cell`` at, after its
    model loads: the Mamba2 backend's track-interval floor on an extra-buffer cell whose track
    interval is below the model's ``mamba_chunk_size``; on a server of the tiny ``twins``, the
    reasoner's one-token think end when the twin's tokenizer splits it."""
    floor = features.track_interval_not_applicable(cell.track_interval, cell.model.mamba_chunk_size) if cell.strategy.has_buffer else None
    if floor or not (twins and enabled(cell, REASONING_REQUESTS)):
        return floor
    return features.think_end_not_applicable(THINK_END_TOKEN, len(TwinTokenizer(ensure_twin(cell.model.twin)).encode(THINK_END_TOKEN)))


def launch_refusal(cell: Cell, log_text: str) -> str | None:
    """SGLang's refusal line when the cell's server stopped while resolving its arguments
    (None: the failure is not an argument refusal).  A cell with server-option axes takes any
    such refusal; a core cell only SGLang's refusal of its strategy for the model's
    architecture (``mamba extra_buffer is not supported for NemotronHForCausalLM model``):
    any other refusal of a core cell stays a failure."""
    line = resolution_refusal(log_text)
    if line is None or cell.options or UNSUPPORTED_FOR_MODEL.search(line):
        return line
    return None


def resolution_refusal(log_text: str) -> str | None:
    """The exception line of the log's last traceback when it runs through SGLang's argument
    resolution (``arg_groups/``, ``server_args.py``): SGLang refused the command at start;
    None for any other failure."""
    tracebacks = log_text.split("Traceback (most recent call last):")
    if len(tracebacks) < 2 or not _RESOLUTION_FRAMES.search(tracebacks[-1]):
        return None
    lines = [ln.strip() for ln in tracebacks[-1].splitlines() if _EXCEPTION_LINE.match(ln.strip())]
    return lines[-1] if lines else None


def log_refusal(cell: Cell, log_path: Path) -> str | None:
    """:func:`launch_refusal` of a server log file (None when it is missing)."""
    try:
        return launch_refusal(cell, Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
