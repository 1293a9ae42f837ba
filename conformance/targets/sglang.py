"""The SGLang target: the exact ``sglang serve`` command and env per cell, and its validation.

``launch_spec`` builds the command (launching nothing); ``validate_server_args`` runs
SGLang's own parser through ``conformance.sglang_api.validate`` (tolerant of every
release in the range) with the model path swapped for a config.json-only folder, so a
command SGLang would refuse fails in CI, not on the GPU box at 3 a.m.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from conformance.matrix import axes
from conformance.errors import KitError
from conformance.matrix.cells import FIXTURES_DIR, Cell
from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.sglang_api.probes import NEW_STRATEGY_FLAG, OLD_STRATEGY_FLAG
from conformance.sglang_api.validate import Validation, validate_args
from conformance.targets.base import LaunchSpec
from conformance.sglang_api import probes
from conformance.reference.twins import ensure_twin # the folder; no model load
from conformance.sglang_plugins import activation
from conformance.sglang_plugins.faults import fault_for_launch

DEFAULT_LAUNCHER = "python -m sglang.launch_server"
CONFIG_DIR = FIXTURES_DIR / "models" / "configs"
#: Where to go without a GPU (the "cannot run here" line of preflight and of a launch).
NO_GPU_HINT = "real SGLang on CPU: --target sglang-cpu (serves the tiny twins); the kit's CPU engine: --target reference"


_DESCRIBING = contextvars.ContextVar("hybrid_conformance_describing_gpus", default=False)


@contextlib.contextmanager
def describing_gpus() -> Iterator[None]:
    """Within this block GPU placement describes (``plan``) instead of launching: ids that
    this machine lacks are shown as absolute indices rather than refused."""
    token = _DESCRIBING.set(True)
    try:
        yield
    finally:
        _DESCRIBING.reset(token)


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without a GPU or a CUDA-enabled torch)."""
    try:
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return int(torch.cuda.device_count())
    except Exception:
        return 0


def visible_gpus() -> tuple[list[str] | None, str]:
    """(device ids servers may use, where they came from).

    An existing ``CUDA_VISIBLE_DEVICES`` mask is the list to map into (trimmed to the
    devices CUDA actually finds, when it finds any); without a mask, ``0..n-1`` for the
    ``n`` devices present; ``None`` when there is neither a mask nor a device.
    """
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = cuda_device_count()
    if mask is not None:
        ids = [d.strip() for d in mask.split(",") if d.strip()]
        if count:
            ids = ids[:count]
        return ids, f"CUDA_VISIBLE_DEVICES={mask}"
    if count:
        return [str(i) for i in range(count)], f"{count} CUDA device(s) found"
    return None, "no CUDA device found"


def worker_index() -> int:
    """This xdist worker's index (``gw3`` -> 3; 0 outside xdist)."""
    m = re.match(r"gw(\d+)$", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
    return int(m.group(1)) if m else 0


def gpus_for_worker(worker_index: int, gpus_per_worker: int) -> list[str]:
    """The GPU ids an xdist worker owns: its contiguous block of ``gpus_per_worker`` positions
    inside the visible devices (an existing ``CUDA_VISIBLE_DEVICES`` is mapped into, never
    overwritten with absolute ids). A block past the visible devices is a :class:`KitError`."""
    lo, hi = worker_index * gpus_per_worker, (worker_index + 1) * gpus_per_worker
    if _DESCRIBING.get():  # plan: no device probe; map into a mask when it is long enough
        mask = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return mask[lo:hi] if hi <= len(mask) else [str(i) for i in range(lo, hi)]
    visible, source = visible_gpus()
    if not visible:
        raise KitError(f"target sglang needs CUDA GPUs and this machine has none ({source}); {NO_GPU_HINT}")
    if hi > len(visible):
        raise KitError(
            f"xdist worker gw{worker_index} needs GPUs #{lo}..#{hi - 1} but only {len(visible)} visible ({source}): "
            f"lower -n or --gpus-per-worker"
        )
    return visible[lo:hi]


@functools.lru_cache(maxsize=8)
def detect_strategy_flag(launcher: str = DEFAULT_LAUNCHER) -> str:
    """The strategy flag the installed SGLang accepts.

    Ask the feature probe (SGLang's own parser) when sglang is importable here; else run
    ``<launcher> --help`` (bounded); else assume the newest name.
    """
    flag = probes.probe().strategy_flag
    if flag:
        return flag
    try:
        out = subprocess.run(
            [*shlex.split(launcher), "--help"], capture_output=True, text=True, timeout=120
        ).stdout
        if NEW_STRATEGY_FLAG in out:
            return NEW_STRATEGY_FLAG
        if OLD_STRATEGY_FLAG in out:
            return OLD_STRATEGY_FLAG
    except (OSError, subprocess.TimeoutExpired):
        pass
    return NEW_STRATEGY_FLAG


@dataclass
class SGLangTarget:
    """Builds per-cell ``sglang serve`` commands; ``twins=True`` serves the tiny twin folders."""

    launcher: str = DEFAULT_LAUNCHER
    twins: bool = False
    strategy_flag: str | None = None
    extra_args: tuple[str, ...] = ()
    name: str = "sglang"

    def supports(self, cell: Cell) -> str | None:
        if self.name not in cell.targets:
            return f"cell is not served by the {self.name} target (matrix 'targets')"
        return None

    def model_path(self, cell: Cell) -> str:
        if self.twins:
            return str(ensure_twin(cell.model.twin))
        return cell.model.hf_path

    def server_args(self, cell: Cell, *, model_path: str, port: int) -> list[str]:
        """The arguments after the launcher (what SGLang's parser sees)."""
        flag = self.strategy_flag or detect_strategy_flag(self.launcher)
        args = [
            "--model-path", model_path,
            flag, cell.strategy.name,
            "--page-size", str(cell.page_size),
            "--mamba-track-interval", str(cell.track_interval),
            "--tp-size", str(1 if self.twins else cell.model.tp_size),
            "--enable-metrics",
            "--host", "127.0.0.1",
            "--port", str(port),
        ]
        args += axes.server_args(cell)  # overlap, streaming sessions, ... (conformance.matrix.axes)
        args += list(cell.cache_variant.args)
        args += list(self.extra_args)
        return args

    def launch_spec(self, cell: Cell, *, port: int, gpus: list[int] | None = None) -> LaunchSpec:
        argv = [*shlex.split(self.launcher), *self.server_args(cell, model_path=self.model_path(cell), port=port)]
        env = dict(cell.env)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        plugins = fault_plugin_env(env)
        return LaunchSpec(argv=argv, env=env, port=port, health_path="/health_generate", start_timeout_s=1200.0, plugins=plugins)


def fault_plugin_env(env: dict[str, str]) -> tuple[str, ...]:
    """With a seeded SGLang fault selected (cell env or the kit's own), switch the kit's fault
    plugin on in ``env`` (added to ``SGLANG_PLUGINS`` when that whitelist is set) and return
    the plugins the launch must prove ran; else change nothing."""
    fault = fault_for_launch(env)
    if not fault:
        return ()
    env[SGLANG_FAULT_ENV] = fault
    allowed = env.get("SGLANG_PLUGINS", os.environ.get("SGLANG_PLUGINS", ""))
    if allowed:
        names = [n.strip() for n in allowed.split(",") if n.strip()]
        env["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*names, activation.FAULT_PLUGIN]))
    return (activation.FAULT_PLUGIN,)


# ------------------------------------------------------------------ validation

def config_folder(cell: Cell, *, twins: bool = False) -> Path:
    """A config.json-only folder with the model's architecture (no weights)."""
    if twins:
        return ensure_twin(cell.model.twin)
    folder = CONFIG_DIR / cell.model.id
    if not (folder / "config.json").exists():
        raise KitError(f"no config.json-only folder for model {cell.model.id!r} at {folder}")
    return folder


def strip_launcher(argv: Sequence[str], launcher: str = DEFAULT_LAUNCHER) -> list[str]:
    prefix = shlex.split(launcher)
    if list(argv[: len(prefix)]) != prefix:
        raise KitError(f"command does not start with the launcher {launcher!r}: {shlex.join(argv[:4])} ...")
    return list(argv[len(prefix):])


def validate_server_args(args: Sequence[str], cell: Cell | None = None, *, config: Path | None = None) -> Validation:
    """SGLang's own parser and resolution on CPU (``conformance.sglang_api.validate``), then
    the cell's expectations: the resolved strategy and mamba cache chunk.

    ``args`` are the arguments after the launcher; the model path is replaced by ``config``
    (or the cell's config folder).  ``status`` is ``na`` when the release predates the
    cell's strategy (its parser's own line as the message).
    """
    if config is None and cell is not None:
        config = config_folder(cell)
    v = validate_args(args, config=config)
    if not v.ok or cell is None:
        return v
    chunk, strategy = v.resolved_chunk, v.resolved_strategy
    if strategy != cell.strategy.name and v.radix_cache_disabled and "--disable-radix-cache" not in args:
        # e.g. a PD decode role on releases that run it without a radix cache
        return Validation(False, f"SGLang disables the radix cache for this command (disable_radix_cache=True; strategy resolved to {strategy!r})", chunk, strategy, status="na")
    if strategy != cell.strategy.name:
        return Validation(False, f"SGLang resolved strategy {strategy!r}, expected {cell.strategy.name!r}", chunk, strategy)
    if chunk is not None and chunk != cell.grid.chunk:
        return Validation(False, f"SGLang resolved mamba cache chunk {chunk}, the matrix says {cell.grid.chunk}", chunk, strategy)
    return v
