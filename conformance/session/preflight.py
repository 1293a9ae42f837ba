"""Preflight: what a run needs, checked before any server starts, one line per need.

``run_preflight`` takes what the run asks for (:class:`Request`: target, selected cells,
suites, GSM8K folder, GPUs) and returns :class:`Line` s in a fixed order:

* ``selection``  the matrix cells the flags select (none is a failure);
* ``gsm8k``      the local folder found and sha256-checked (or ``datasets`` reachable),
  when a selected suite scores GSM8K;
* ``gpus``       the GPUs the cells need per server and per worker are visible
  (target ``sglang``), or why this target cannot run here and which target can;
* ``sglang``     the installed SGLang's version and the features the selection needs
  (strategies its parser accepts, HiCache, PD), probed in a child interpreter so a
  slow or broken import cannot hang the run; for ``sglang-cpu`` also the kit's entry
  points and the ``sgl_kernel`` stand-in;
* ``twins``      the tiny twins the cells serve (cached or generated on first use);
* ``ports``      local ports can be bound.

Nothing here starts a server. Targets differ only in which needs apply.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Sequence

from conformance.errors import KitError
from conformance.matrix.cells import Cell
from conformance.session.options import Options
from conformance.targets.registry import target_for
from conformance.workloads import gsm8k
from conformance.targets.sglang import NO_GPU_HINT, visible_gpus
from conformance.sglang_plugins import activation
from conformance.targets.sglang_cpu import STANDIN_PATH
from conformance.targets import preimport
from conformance.sglang_api.probes import MOONCAKE_DISTS
from conformance.targets.pd_launch import CPU_TRANSFER_BACKEND, CPU_TRANSFER_ENV, CPU_TRANSFER_PROTOCOL
from conformance.reference import twins

if TYPE_CHECKING:  # annotations only: the CLI's preflight runs without pytest
    import pytest

GSM8K_SUITES = ("gsm8k", "disagg")
PROBE_TIMEOUT_S = 300.0
#: When set (to anything but 0), ``run`` and the pytest plugin stop after preflight and
#: selection: what a docs test uses to run a long command exactly as typed.
PREFLIGHT_ONLY_ENV = "HYBRID_CONFORMANCE_PREFLIGHT_ONLY"
#: Where ``hybrid-conformance run`` leaves its preflight for the plugin to put in report.json.


@dataclass(frozen=True)
class Line:
    """One need of the run: met (``ok``) or not, in one line; ``hint`` says what can run instead."""

    name: str
    ok: bool
    text: str
    hint: str = ""

    def render(self) -> str:
        return f"preflight {self.name:<9} {'ok  ' if self.ok else 'FAIL'} {self.text}"


@dataclass(frozen=True)
class Request:
    """What a run asks for."""

    target: str
    cells: tuple[Cell, ...]
    suites: tuple[str, ...]
    gsm8k_dir: str | None = None
    gpus_per_worker: int = 1
    workers: int = 1
    twins: bool = False
    selection: str = ""  # the flags, for the "selects no cell" line
    probe_sglang: bool = True  # import SGLang in a child interpreter for version and features


@dataclass(frozen=True)
class Preflight:
    lines: tuple[Line, ...]

    @property
    def ok(self) -> bool:
        return all(line.ok for line in self.lines)

    @property
    def failures(self) -> list[Line]:
        return [line for line in self.lines if not line.ok]

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(line) for line in self.lines]


def preflight_only() -> bool:
    return os.environ.get(PREFLIGHT_ONLY_ENV, "") not in ("", "0")


def run_preflight(req: Request, *, on_line: Callable[[Line], None] | None = None) -> Preflight:
    """Every applicable check in order; ``on_line`` sees each line as soon as it is known.
    Checks after the first failure still run when they are cheap, so one run names every
    missing need; the SGLang import probe is skipped once something else already failed."""
    lines: list[Line] = []
    for check in (selection_line, gpu_line, sglang_line, plugins_line, launch_line, pd_transport_line, gsm8k_line, twins_line, ports_line):
        if check is sglang_line and lines and not all(x.ok for x in lines):
            req = _replace(req, probe_sglang=False)
        line = check(req)
        if line is None:
            continue
        lines.append(line)
        if on_line:
            on_line(line)
    return Preflight(tuple(lines))


def _replace(req: Request, **changes: object) -> Request:
    from dataclasses import replace

    return replace(req, **changes)


# ------------------------------------------------------------------ selection


def selection_line(req: Request) -> Line:
    if not req.cells:
        where = f" ({req.selection})" if req.selection else ""
        return Line("selection", False, f"the selection matches no cell of the matrix on target {req.target}{where}", "see `hybrid-conformance plan` for the cells")
    models = sorted({c.model.id for c in req.cells})
    return Line("selection", True, f"{len(req.cells)} cells on target {req.target} ({len(models)} models); suites {', '.join(req.suites) or '-'}")


# ------------------------------------------------------------------ GSM8K


def needs_gsm8k(suites: Sequence[str], cells: Sequence[Cell]) -> bool:
    """A suite that scores GSM8K is selected (PD only for cells with a PD variant)."""
    return "gsm8k" in suites or ("disagg" in suites and any(c.strategy.pd for c in cells))


def gsm8k_line(req: Request) -> Line:
    if not needs_gsm8k(req.suites, req.cells):
        return Line("gsm8k", True, "not needed by the selected suites")
    return check_gsm8k(req.gsm8k_dir)


def check_gsm8k(directory: str | None) -> Line:
    """The local folder sha256-checked; else the hub that lm-eval would load it from must
    at least be reachable (checked with a 3 s connect, nothing downloaded)."""
    d = directory or os.environ.get(gsm8k.ENV_DIR)
    hint = f"point --gsm8k-dir or {gsm8k.ENV_DIR} at a folder with {gsm8k.TEST_FILE} and {gsm8k.TRAIN_FILE}"
    try:
        data = gsm8k.load_gsm8k(d)
    except KitError as e:
        return Line("gsm8k", False, str(e), "" if "--gsm8k-dir" in str(e) else hint)
    if not data.local and not _hub_reachable():
        return Line("gsm8k", False, "no local GSM8K folder given and huggingface.co is unreachable (lm-eval would fail to load openai/gsm8k)", hint)
    where = f"{d} (sha256 ok)" if data.local else f"{data.source} (loaded by lm-eval at run time)"
    return Line("gsm8k", True, f"{where}: {data.n_test} test items, {data.n_train} few-shot exemplars")


def _hub_reachable(host: str = "huggingface.co", timeout_s: float = 3.0) -> bool:
    import socket

    try:
        with socket.create_connection((host, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------ GPUs


def gpus_needed(cell: Cell, *, twins: bool, suites: Sequence[str]) -> int:
    """GPUs one worker needs for ``cell``: its server's tp, three times that for a PD cell
    (the non-PD server, prefill and decode)."""
    tp = 1 if twins else cell.model.tp_size
    return 3 * tp if "disagg" in suites and cell.strategy.pd else tp


def gpu_line(req: Request) -> Line:
    if not target_for(req).needs().gpus:
        return Line("gpus", True, f"not needed (target {req.target} runs on CPU)")
    if not req.cells:
        return Line("gpus", True, "no cell selected")
    need = max(gpus_needed(c, twins=req.twins, suites=req.suites) for c in req.cells)
    worst = max(req.cells, key=lambda c: gpus_needed(c, twins=req.twins, suites=req.suites))
    visible, source = visible_gpus()
    if not visible:
        return Line("gpus", False, f"target {req.target} serves on CUDA GPUs (cell {worst.id} needs {need}); this machine has none ({source})", NO_GPU_HINT)
    if need > req.gpus_per_worker:
        return Line("gpus", False, f"cell {worst.id} needs {need} GPUs per worker but --gpus-per-worker is {req.gpus_per_worker}",
                    f"use --gpus-per-worker {need} (or select cells with a smaller tp size)")
    total = max(1, req.workers) * req.gpus_per_worker
    if total > len(visible):
        return Line("gpus", False, f"{max(1, req.workers)} workers x {req.gpus_per_worker} GPUs = {total}, but {len(visible)} visible ({source})",
                    "lower -n or --gpus-per-worker")
    return Line("gpus", True, f"{len(visible)} visible ({source}); cells need up to {need} per worker, {total} used")


# ------------------------------------------------------------------ SGLang




def sglang_version() -> str | None:
    """The installed SGLang's version from its package metadata (no import)."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def probe_sglang(timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """SGLang's answers from the kit's one adapter (``conformance.sglang_api.probes``), in a
    child interpreter so a broken SGLang cannot take the preflight down; the probe caches
    its answers per installation, so only the first run pays SGLang's import."""
    try:
        out = subprocess.run([sys.executable, "-m", "conformance.sglang_api.probes", "--json"], capture_output=True, text=True,
                             timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"error": f"importing sglang took longer than {timeout_s:.0f}s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == 0 and lines:
        data = json.loads(lines[-1])
        return {**data, "error": data.get("import_error")}
    tail = [ln for ln in out.stderr.splitlines() if ln.strip()]
    return {"error": f"the probe exited {out.returncode}: {tail[-1][:200] if tail else 'no output'}"}


def features_needed(req: Request) -> dict[str, Any]:
    """What the selection asks of SGLang's parser."""
    needs = target_for(req).needs()
    flags = set(needs.sglang_flags)
    if any(c.cache_variant.name == "hicache" for c in req.cells):
        flags.add("--enable-hierarchical-cache")
    if "disagg" in req.suites:
        flags.update(needs.pd_sglang_flags)
    return {"strategies": sorted({c.strategy.name for c in req.cells}), "flags": sorted(flags)}


def sglang_line(req: Request) -> Line:
    version = sglang_version()
    needs = target_for(req).needs()
    if not needs.sglang:
        installed = f"sglang {version} installed" if version else "sglang not installed"
        return Line("sglang", True, f"not used: target {req.target} is the kit's own engine, not SGLang ({installed})")
    if version is None:
        return Line("sglang", False, f"target {req.target} needs SGLang and it is not installed", "run `bash ci/setup-cpu.sh` (CPU) or install sglang")
    if not req.probe_sglang or not needs.probe:
        return Line("sglang", True, f"sglang {version} (package metadata; import not probed)")
    probe = probe_sglang()
    if probe.get("error"):
        return Line("sglang", False, f"sglang {version} is installed but does not import: {probe['error']}", "")
    need = features_needed(req)
    missing = [s for s in need["strategies"] if s not in probe.get("strategies", [])]
    missing += [f for f in need["flags"] if f not in probe.get("flags", [])]
    if missing:
        return Line("sglang", False, f"sglang {probe.get('version') or version} lacks what the selection needs: {', '.join(missing)} "
                                     f"(its {probe.get('strategy_flag') or 'strategy flag'} accepts {', '.join(probe.get('strategies', [])) or 'nothing'})",
                    "narrow --strategies or install a newer SGLang")
    have = ", ".join([f"{probe.get('strategy_flag')} {'/'.join(need['strategies'])}", *need["flags"]])
    return Line("sglang", True, f"sglang {probe.get('version') or version} imports; accepts {have}")


def plugins_line(req: Request) -> Line | None:
    """sglang-cpu: the kit's entry points are registered where SGLang looks, and the stand-in exists."""
    if not target_for(req).needs().plugins:
        return None
    want = {"sglang.srt.plugins": {activation.CPU_PLUGIN, activation.OBSERVE_PLUGIN, activation.FAULT_PLUGIN}, "sglang.srt.platforms": {activation.PLATFORM_NAME}}
    missing = [f"{group}:{name}" for group, names in want.items() for name in sorted(names - {ep.name for ep in metadata.entry_points(group=group)})]
    if missing:
        return Line("plugins", False, f"the kit's SGLang entry points are not registered: {', '.join(missing)}", "reinstall the kit: pip install -e .")
    if not (STANDIN_PATH / "sgl_kernel" / "__init__.py").is_file():
        return Line("plugins", False, f"the sgl_kernel stand-in is missing under {STANDIN_PATH}", "reinstall the kit")
    return Line("plugins", True, f"entry points {', '.join(sorted(set().union(*want.values())))} registered; sgl_kernel stand-in present")


def launch_line(req: Request) -> Line | None:
    """sglang-cpu: how its servers will start (``HYBRID_CONFORMANCE_LAUNCH``, checked here)."""
    if not target_for(req).needs().plugins:
        return None
    try:
        mode = preimport.mode()
    except KitError as e:
        return Line("launch", False, str(e))
    how = {"plain": "each as the plain python -m sglang.launch_server command",
           "preimported": "forked from a process that imported SGLang's server stack once; SGLang spawns its children",
           "preimported-fork": "forked from a pre-imported process, SGLang's children forked too"}[mode]
    return Line("launch", True, f"{preimport.LAUNCH_ENV}={mode}: servers start {how}")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def pd_transport_line(req: Request) -> Line | None:
    """The disagg suite on a target whose PD transfer SGLang itself may refuse (sglang-cpu):
    which transport the PD cells will use, or SGLang's own refusal (then they are n/a, the
    rest of the run goes on).  Read from the same child-interpreter probe as the sglang line."""
    if "disagg" not in req.suites or not target_for(req).needs().pd_transport or not any(c.strategy.pd for c in req.cells):
        return None
    engine = _dist_version(*reversed(MOONCAKE_DISTS)) or "no mooncake distribution installed"
    router = _dist_version("sglang-router") or "sglang-router not installed"
    env = " ".join(f"{k}={v}" for k, v in CPU_TRANSFER_ENV.items())
    refusal = probe_sglang().get("pd_transfer_refusal") if req.probe_sglang else None
    if refusal:
        return Line("pd", True, f"PD cells n/a: SGLang's {CPU_TRANSFER_BACKEND} transfer engine refuses this machine: {refusal} ({engine})",
                    "bash ci/setup-cpu.sh installs the CPU Mooncake wheel and its Debian libraries")
    return Line("pd", True, f"transport {CPU_TRANSFER_BACKEND} over {CPU_TRANSFER_PROTOCOL} ({env}; {engine}); router {router}")


# ------------------------------------------------------------------ twins and ports


def twins_line(req: Request) -> Line | None:
    if not target_for(req).serves_twins(req.twins) or not req.cells:
        return None
    names = sorted({c.model.twin for c in req.cells})
    try:
        cached = [n for n in names if (twins.twin_folder(twins.load_spec(n)) / "config.json").is_file()]
    except KitError as e:
        return Line("twins", False, str(e))
    rest = f"; {len(names) - len(cached)} generated on first use" if len(cached) < len(names) else ""
    return Line("twins", True, f"{', '.join(names)}: {len(cached)}/{len(names)} cached in {twins.cache_root()}{rest}")


def ports_line(req: Request) -> Line:
    try:
        socks = []
        for _ in range(3):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        for s in socks:
            s.close()
    except OSError as e:
        return Line("ports", False, f"cannot bind a local port on 127.0.0.1: {e.strerror or e}")
    return Line("ports", True, "127.0.0.1 ports bindable; each server gets a free port at launch")




# ------------------------------------------------------------------ pytest items


def _needs_gsm8k_item(item: pytest.Item, cell: Cell) -> bool:
    if "gsm8k_data" in getattr(item, "fixturenames", ()):
        return True
    is_pd_gsm8k = item.get_closest_marker("disagg") is not None and "gsm8k" in item.name
    return is_pd_gsm8k and needs_gsm8k(("disagg",), (cell,))


def item_failures(items: Sequence[pytest.Item], options: Options) -> dict[str, str]:
    """``{nodeid: the need it lacks}`` for collected tests bound to a cell: GSM8K data,
    GPUs (target sglang), SGLang and the kit's entry points (sglang targets). Cheap checks
    only (no SGLang import), each done once; the plugin fails those tests at setup, in
    one line, before any server starts."""
    cache: dict[str, Line | None] = {}

    def once(key: str, fn: Callable[[], Line | None]) -> Line | None:
        if key not in cache:
            cache[key] = fn()
        return cache[key]

    out: dict[str, str] = {}
    needs = target_for(options).needs()
    for item in items:
        cell = getattr(getattr(item, "callspec", None), "params", {}).get("cell")
        if not isinstance(cell, Cell) or item.get_closest_marker("pool") is not None:
            continue
        served = "endpoint" in getattr(item, "fixturenames", ()) or item.get_closest_marker("disagg") is not None
        problems: list[Line | None] = []
        if served and needs.sglang:
            problems.append(once("sglang", lambda: None if sglang_version() else Line("sglang", False, f"target {options.target} needs SGLang and it is not installed")))
        if served and needs.plugins:
            problems.append(once("plugins", lambda: plugins_line(Request(target=options.target, cells=(), suites=()))))
        if served and needs.gpus:
            suites = ("disagg",) if item.get_closest_marker("disagg") is not None else ()
            need = gpus_needed(cell, twins=options.twins, suites=suites)
            problems.append(once(f"gpus:{need}", lambda: gpu_line(Request(target=options.target, cells=(cell,), suites=suites, gpus_per_worker=options.gpus_per_worker, twins=options.twins))))
        if _needs_gsm8k_item(item, cell):
            problems.append(once("gsm8k", lambda: check_gsm8k(options.gsm8k_dir)))
        bad = next((p for p in problems if p is not None and not p.ok), None)
        if bad is not None:
            out[item.nodeid] = bad.text + (f" ({bad.hint})" if bad.hint else "")
    return out
