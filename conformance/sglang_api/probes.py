"""Feature probes of the installed SGLang: one frozen :class:`Features` record.

Every difference between SGLang releases that the kit depends on is answered here by
looking at the installed code (``hasattr``, ``inspect.signature``, a module's presence,
the strategy flag's choices in SGLang's own parser, one config constructed), never by
comparing version numbers.  The version is only printed.  Importing this module does not
import sglang; :func:`probe` does, once per installation (the answers are kept in a file
keyed by the installed sglang and transformers and this module's code).

``Features.summary()`` is the one line printed at start, e.g.
``sglang 0.5.13: lazy strategy absent -> lazy cells not applicable; ...``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, fields

from conformance.matrix import axes
from conformance.matrix.strategy import LAZY
from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.cpu import device_gate
from conformance.sglang_plugins.faults.catalogue import faults

NEW_STRATEGY_FLAG = "--mamba-radix-cache-strategy"
OLD_STRATEGY_FLAG = "--mamba-scheduler-strategy"


@dataclass(frozen=True)
class Features:
    """What the installed SGLang offers the kit (each field a probe's answer)."""

    version: str
    import_error: str | None = None  # why ``import sglang.srt...`` failed (None: it worked)
    strategy_flag: str | None = None  # the radix-cache strategy flag SGLang's parser takes
    strategies: tuple[str, ...] = ()  # that flag's choices
    req_kv: bool = False  # request cache state on ``req.kv`` (ReqKvInfo) rather than on the Req
    runtime_context: bool = False  # sglang.srt.runtime_context
    override_platform: bool = False  # runtime_context.override_platform
    mamba_track_grid: bool = False  # runtime_context.mamba_track_grid
    mem_allocation: bool = False  # sglang.srt.mem_cache.allocation
    mamba_slot_allocator: bool = False  # mem_cache.allocator.mamba.MambaSlotAllocator
    scheduler_components: bool = False  # managers.scheduler_components
    unified_components: bool = False  # mem_cache.unified_cache.components
    checkpoint_kv_cache: bool = False  # mem_cache.common.checkpoint_kv_cache
    release_insert_kwarg: str | None = None  # release_kv_cache's insert keyword: checkpoint | is_insert
    gather_track_indices: bool = False  # schedule_batch._gather_mamba_track_indices
    mamba_radix_cache: bool = False  # mem_cache.mamba_radix_cache.MambaRadixCache (pre-unified tree)
    session_slot_save: bool = False  # streaming SessionSlot.save_from_req (the pre-0.5.19 session slot)
    granite_new_layer_names: bool = False  # granite config takes linear_attention/full_attention
    general_plugins: bool = False  # sglang.srt.plugins.load_plugins (entry-point group sglang.srt.plugins)
    oot_platforms: bool = False  # sglang.srt.platforms.interface.SRTPlatform (out-of-tree platforms)
    platform_extra_buffer_answer: bool = False  # SRTPlatform.support_mamba_cache_extra_buffer (a platform may allow extra_buffer)
    hook_registry: bool = False  # sglang.srt.plugins.hook_registry.HookRegistry (the CPU stand-ins' REPLACE hooks)
    extra_buffer_gate: str | None = None  # where extra_buffer is gated on the device: "platform", "server_args" (an in-method assert), None
    extra_buffer_gate_method: str | None = None  # with "server_args": the ServerArgs method holding the assert
    tree_class: str | None = None  # the radix tree a hybrid model gets by default: UnifiedRadixCache | MambaRadixCache
    mamba_used_gauge: bool = True  # SGLang publishes sglang:mamba_used_tokens (0.5.11 has only sglang:mamba_usage, a fraction)
    flags: tuple[str, ...] = ()  # which of PARSER_FLAGS SGLang's parser takes
    choices: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (flag, its choices) for the PARSER_FLAGS that have choices
    pd_transfer_refusal: str | None = None  # SGLang's own line when its default PD transfer engine cannot be built here
    missing_hook_targets: tuple[tuple[str, str], ...] = ()  # (seeded fault's hook target, SGLang's line) that do not resolve here
    paged_alloc_triton_only: bool = False  # PagedTokenToKVPoolAllocator.alloc_extend launches its Triton kernel with no other path
    #: the unified radix tree's cores the release registers (``tree_core_registry``, 0.5.19+; None: not probed yet)
    tree_cores: tuple[str, ...] | None = None
    #: SGLang's Mamba2 backend asserts ``mamba_track_interval >= mamba_chunk_size`` with the extra buffer (0.5.13+)
    mamba2_track_floor: bool = False
    #: SGLang's reasoner grammar backend requires the think-end token to encode to one token (up to 0.5.16)
    think_end_single_token: bool = False
    #: SGLang's own words where a hybrid model's HiCache tree stores no Mamba state at a branch
    #: point (the unified tree's MambaComponent fills branching states only without a cache
    #: controller, 0.5.13-0.5.16); None where it does
    hicache_branching_skipped: str | None = None
    #: SGLang's own test switches (``SGLANG_TEST_*``) its ``sglang.srt.environ.Envs`` declares (None: not probed yet)
    test_switches: tuple[str, ...] | None = None

    def test_switch_missing(self, env) -> str | None:
        """SGLang's own line for the first of its test switches (``SGLANG_TEST_*`` names in
        ``env``, e.g. a cell fault's) this release does not declare (None: all declared)."""
        if not self.importable or not self.test_switches:  # not probed, or a release that declares none in Envs
            return None
        missing = [name for name in env if name.startswith(TEST_SWITCH_PREFIX) and name not in self.test_switches]
        if not missing:
            return None
        return (f"sglang {self.version}: sglang.srt.environ.Envs has no {missing[0]} "
                f"({len(self.test_switches)} {TEST_SWITCH_PREFIX}* switches, not this one): SGLang would ignore it")

    def hook_target_missing(self, targets) -> str | None:
        """SGLang's own line for the first of ``targets`` this release lacks (None: all resolve)."""
        missing = dict(self.missing_hook_targets)
        return next((f"{t}: {missing[t]}" for t in targets if t in missing), None)

    # ------------------------------------------------------------ derived answers
    @property
    def importable(self) -> bool:
        return self.import_error is None

    @property
    def lazy(self) -> bool:
        return any(name in self.strategies for name in LAZY)

    @property
    def pool_driver(self) -> str | None:
        """Which pool-tier driver fits: ``kv`` (req.kv lifecycle), ``legacy`` (state on the Req)."""
        if not self.importable:
            return None
        if self.req_kv and self.checkpoint_kv_cache and self.unified_components:
            return "kv"
        if not self.req_kv and self.mamba_radix_cache and self.release_insert_kwarg == "is_insert":
            return "legacy"
        return None

    @property
    def sglang_cpu_gap(self) -> str | None:
        """What the sglang-cpu target needs and this release lacks, in one line (None: nothing).
        The out-of-tree platform is used only where its interface answers extra_buffer; without
        that answer the device gate is reached through a general-plugin hook (``extra_buffer_gate``)."""
        if not self.importable:
            return f"sglang {self.version} is not importable ({self.import_error})"
        if not self.general_plugins:
            return f"sglang {self.version} has no general plugins (sglang.srt.plugins.load_plugins)"
        if not self.hook_registry:
            return f"sglang {self.version} has no hook registry (sglang.srt.plugins.hook_registry.HookRegistry)"
        return None

    @property
    def sglang_cpu_capable(self) -> bool:
        """SGLang's extension points the sglang-cpu target runs through are all there."""
        return self.sglang_cpu_gap is None

    def not_applicable(self, strategy: str) -> str | None:
        """SGLang's own reason a strategy cannot be asked of this release (None: it can)."""
        if not self.importable:
            return None
        if strategy not in self.strategies:
            choices = ", ".join(self.strategies) or "none"
            return f"sglang {self.version}: {self.strategy_flag or 'the strategy flag'} has no {strategy!r} (choices: {choices})"
        return None

    def device_gate_not_applicable(self) -> str | None:
        """The missing capability when sglang-cpu cannot serve an extra_buffer strategy: neither
        a platform answer nor a device assert the CPU plugin's hook answers (None: one of them)."""
        if not self.importable or self.extra_buffer_gate is not None:
            return None
        return (f"sglang {self.version}: extra_buffer is gated on the device and nothing here answers it on CPU "
                f"(no SRTPlatform.support_mamba_cache_extra_buffer, no device assert the CPU plugin's hook knows "
                f"in ServerArgs._validate_mamba_extra_buffer/_handle_mamba_radix_cache or arg_groups.mamba_hook.validate_mamba_extra_buffer)")

    def option_not_applicable(self, needs) -> str | None:
        """SGLang's own line for the first (flag, choice) of a cell's server-option axes
        (``conformance.matrix.axes.needed``) this release's parser lacks (None: it has them all)."""
        if not self.importable:
            return None
        choices = dict(self.choices)
        for flag, choice in needs:
            if flag == axes.TREE_CORE_ENV:
                if choice not in (self.tree_cores or ()):
                    return (f"sglang {self.version}: {axes.TREE_CORE_ENV}={choice!r} is not registered: registered backends: "
                            f"{list(self.tree_cores or ())} (no sglang.srt.mem_cache.unified_cache.tree_core_registry before 0.5.19)")
                continue
            if flag not in self.flags:
                return f"sglang {self.version}: error: unrecognized arguments: {flag}"
            if choice is not None and flag in choices and choice not in choices[flag]:
                offered = ", ".join(repr(c) for c in choices[flag])
                return f"sglang {self.version}: error: argument {flag}: invalid choice: {choice!r} (choose from {offered})"
        return None

    def track_interval_not_applicable(self, track_interval: int, model_chunk: int) -> str | None:
        """SGLang's own assert when an extra-buffer server's track interval is below the model's
        ``mamba_chunk_size`` (``Mamba2AttnBackend``; None: the release takes it)."""
        if not self.importable or not self.mamba2_track_floor or track_interval >= model_chunk:
            return None
        return (f"sglang {self.version}: AssertionError: mamba_track_interval ({track_interval}) must be >= "
                f"mamba_chunk_size ({model_chunk}) (Mamba2AttnBackend with the extra buffer)")

    def think_end_not_applicable(self, token: str, n_tokens: int) -> str | None:
        """SGLang's own refusal when its reasoning parser's think-end ``token`` encodes to
        ``n_tokens`` tokens and the release needs exactly one (None: the release takes it)."""
        if not self.importable or not self.think_end_single_token or n_tokens == 1:
            return None
        return (f"sglang {self.version}: ValueError: think_end_token '{token}' must encode to exactly one token for "
                f"constrained reasoning. (the served tokenizer encodes it to {n_tokens})")

    def summary(self) -> str:
        """The one line printed at start: each probe and what follows from it."""
        if not self.importable:
            return f"sglang {self.version}: not importable ({self.import_error}) -> nothing runs against it"
        parts = [
            f"lazy strategy {'present' if self.lazy else 'absent -> lazy cells not applicable'}",
            f"strategy flag {self.strategy_flag}",
            f"req.kv lifecycle {'present' if self.req_kv else 'absent'} -> pool driver {self.pool_driver or 'none (pool tier not applicable)'}",
            f"override_platform {'present' if self.override_platform else 'absent -> validator answers server_args.is_cuda'}",
            f"release_kv_cache(*, {self.release_insert_kwarg})",
            f"MambaSlotAllocator {'present' if self.mamba_slot_allocator else 'absent (mamba_pool.alloc/free)'}",
            f"_gather_mamba_track_indices {'present' if self.gather_track_indices else 'absent (kit indexes the ping-pong mapping)'}",
            f"granite layer names {'linear_attention/full_attention' if self.granite_new_layer_names else 'mamba/attention only -> granite configs rewritten'}",
            f"tree {self.tree_class or 'unknown'}",
            *(() if self.mamba_used_gauge else (f"no {MAMBA_USED_TOKENS} gauge -> the observe plugin publishes SGLang's PoolStats mamba terms in its place (conformance.client.GAUGE_STANDINS)",)),
            f"sglang-cpu {'runs through general plugins + hook registry' if self.sglang_cpu_capable else 'not applicable (' + str(self.sglang_cpu_gap) + ')'}"
            f", extra_buffer device gate {self._gate_text()}",
            f"seeded-fault hook targets {'all resolve' if not self.missing_hook_targets else f'{len(self.missing_hook_targets)} missing -> their faults not applicable'}",
            *((f"paged allocator launches {PAGED_ALLOC_KERNEL} only -> sglang-cpu runs page sizes above 1 under TRITON_INTERPRET=1",)
              if self.paged_alloc_triton_only else ()),
        ]
        return f"sglang {self.version}: " + "; ".join(parts)

    def _gate_text(self) -> str:
        return {"platform": "answered by the kit's out-of-tree platform",
                "server_args": f"in {self._gate_method_text()} (answered by the CPU plugin's hook)"}.get(
                    self.extra_buffer_gate or "", "not found -> extra_buffer cells not applicable on sglang-cpu")

    def _gate_method_text(self) -> str:
        method = self.extra_buffer_gate_method or "_handle_mamba_radix_cache"
        return method if "." in method else f"ServerArgs.{method}"  # 0.5.19-0.5.21: a module function, dotted

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "lazy": self.lazy, "pool_driver": self.pool_driver, "sglang_cpu_capable": self.sglang_cpu_capable,
            "sglang_cpu_gap": self.sglang_cpu_gap}


def _module(name: str):
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):
        return None
    return importlib.import_module(name)


#: Flags a selection may need, looked up in SGLang's own parser.
PARSER_FLAGS = tuple(dict.fromkeys((
    "--enable-hierarchical-cache", "--disaggregation-mode", "--mamba-track-interval", "--device",
    "--enable-streaming-session", "--sleep-on-idle",
    # every flag a server-option axis value passes (conformance.matrix.axes)
    *(v.needs[0] for a in axes.AXES.values() for v in a.values.values() if v.needs),
)))


def _strategy_flag() -> tuple[str | None, tuple[str, ...], tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
    """(the strategy flag, its choices, which of :data:`PARSER_FLAGS` exist, their choices)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    actions = parser._option_string_actions  # argparse has no public accessor
    flags = tuple(f for f in PARSER_FLAGS if f in actions)
    choices = tuple((f, tuple(actions[f].choices)) for f in flags if actions[f].choices)
    for flag in (NEW_STRATEGY_FLAG, OLD_STRATEGY_FLAG):
        action = actions.get(flag)
        if action is not None:
            return flag, tuple(action.choices or ()), flags, choices
    return None, (), flags, choices


#: The distributions that provide ``mooncake.engine`` (CUDA and CPU builds).
MOONCAKE_DISTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


_ENGINE_CHILD = """
import sys
from conformance.sglang_api.probes import _engine_refusal_here
print("REFUSAL:" + (_engine_refusal_here() or ""))
"""


def _pd_transfer_refusal() -> str | None:
    """SGLang's own answer when asked for its default PD transfer engine (Mooncake) here.
    Asked in a child interpreter: building the engine binds ports and writes Mooncake's C++
    log lines to the process's stderr, which ``plan`` and ``preflight`` must not show."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _ENGINE_CHILD], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "the Mooncake transfer engine did not build within 120s"
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("REFUSAL:")), None)
    if line is None:
        tail = [ln for ln in out.stderr.splitlines() if ln.strip()][-1:] or [f"exit {out.returncode}"]
        return f"the transfer-engine probe failed: {tail[0][:200]}"
    return line[len("REFUSAL:"):] or None


def _engine_refusal_here() -> str | None:
    """In the probe's child: build SGLang's Mooncake transfer engine; why not, or None."""
    mod = _module("sglang.srt.distributed.device_communicators.mooncake_transfer_engine")
    engine = getattr(mod, "MooncakeTransferEngine", None)
    if engine is None:
        return "this release has no Mooncake transfer engine module"
    try:
        engine("127.0.0.1")
    except ImportError as e:
        return " ".join(str(e).split())
    except Exception as e:  # built, but cannot run here
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def _mamba_state_on_req_kv(schedule_batch) -> bool:
    """Whether the request's mamba cache state lives in ``ReqKvInfo`` (``req.kv``)."""
    import dataclasses

    info = getattr(schedule_batch, "ReqKvInfo", None)
    if info is None:
        return False
    if dataclasses.is_dataclass(info):
        return "mamba_pool_idx" in {f.name for f in dataclasses.fields(info)}
    try:
        return hasattr(info(), "mamba_pool_idx")
    except TypeError:
        return "mamba_pool_idx" in inspect.getsource(info)


def _granite_takes_new_names() -> bool:
    mod = _module("sglang.srt.configs.granitemoehybrid")
    if mod is None:
        return True  # no SGLang-side config class: transformers' own spelling is the one read
    try:
        mod.GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    except Exception:
        return False
    return True


def _tree_class() -> str | None:
    """The radix tree SGLang's default factory builds for a hybrid (Mamba) model."""
    registry = _module("sglang.srt.mem_cache.registry")
    factory = getattr(registry, "default_radix_cache_factory", None)
    if factory is not None:
        return "MambaRadixCache" if "MambaRadixCache(" in inspect.getsource(factory) else "UnifiedRadixCache"
    return "MambaRadixCache" if hasattr(_module("sglang.srt.mem_cache.mamba_radix_cache"), "MambaRadixCache") else None


def _mamba_used_gauge() -> bool:
    """Whether SGLang's metrics collector publishes ``sglang:mamba_used_tokens`` (from its source)."""
    collector = _module("sglang.srt.observability.metrics_collector") or _module("sglang.srt.metrics.collector")
    try:
        return collector is not None and MAMBA_USED_TOKENS.partition(":")[2] in inspect.getsource(collector)
    except (OSError, TypeError):
        return False


def _extra_buffer_gate() -> str | None:
    where = device_gate.gate_location()
    return where if where in (None, "platform") else "server_args"


def _extra_buffer_gate_method() -> str | None:
    where = device_gate.gate_location()
    if where in (None, "platform"):
        return None
    return where.removeprefix("sglang.srt.") if where in device_gate.PLATFORM_TARGETS else where.rsplit(".", 1)[-1]


def _fault_hook_targets() -> tuple[str, ...]:
    """Every SGLang symbol a seeded fault of the kit hooks (the catalogue imports no SGLang)."""
    return tuple(sorted({h.target for f in faults().values() for h in f.hooks}))


def _unresolved(targets: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(target, SGLang's own error line) for each dotted symbol that does not resolve."""
    import pkgutil

    out = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as e:
            out.append((target, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
    return tuple(out)


def _probe() -> Features:
    try:
        import sglang

        version = str(getattr(sglang, "__version__", "unknown"))
    except Exception as e:
        return Features(version="(not installed)", import_error=f"{type(e).__name__}: {e}")
    try:
        schedule_batch = importlib.import_module("sglang.srt.managers.schedule_batch")
        common = importlib.import_module("sglang.srt.mem_cache.common")
        flag, strategies, flags, choices = _strategy_flag()
    except Exception as e:  # e.g. an incompatible transformers: "'qwen3_asr' is already used ..."
        return Features(version=version, import_error=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    runtime = _module("sglang.srt.runtime_context")
    allocation = _module("sglang.srt.mem_cache.allocation")
    release = getattr(allocation, "release_kv_cache", None) or getattr(common, "release_kv_cache", None)
    params = inspect.signature(release).parameters if release is not None else {}
    kwarg = next((k for k in ("checkpoint", "is_insert") if k in params), None)
    allocator = _module("sglang.srt.mem_cache.allocator.mamba")
    mamba_tree = _module("sglang.srt.mem_cache.mamba_radix_cache")
    session = _module("sglang.srt.session.streaming_session")
    slot_cls = getattr(session, "SessionSlot", None)
    return Features(
        version=version,
        strategy_flag=flag,
        strategies=strategies,
        req_kv=_mamba_state_on_req_kv(schedule_batch),
        runtime_context=runtime is not None,
        override_platform=hasattr(runtime, "override_platform"),
        mamba_track_grid=hasattr(runtime, "mamba_track_grid"),
        mem_allocation=allocation is not None,
        mamba_slot_allocator=hasattr(allocator, "MambaSlotAllocator"),
        scheduler_components=_module("sglang.srt.managers.scheduler_components") is not None,
        unified_components=_module("sglang.srt.mem_cache.unified_cache.components") is not None,
        checkpoint_kv_cache=hasattr(common, "checkpoint_kv_cache") or hasattr(allocation, "checkpoint_kv_cache"),
        release_insert_kwarg=kwarg,
        gather_track_indices=hasattr(schedule_batch, "_gather_mamba_track_indices"),
        mamba_radix_cache=hasattr(mamba_tree, "MambaRadixCache"),
        session_slot_save=hasattr(slot_cls, "save_from_req"),
        granite_new_layer_names=_granite_takes_new_names(),
        general_plugins=hasattr(_module("sglang.srt.plugins"), "load_plugins"),
        oot_platforms=hasattr(_module("sglang.srt.platforms.interface"), "SRTPlatform"),
        platform_extra_buffer_answer=hasattr(getattr(_module("sglang.srt.platforms.interface"), "SRTPlatform", None), "support_mamba_cache_extra_buffer"),
        hook_registry=hasattr(_module("sglang.srt.plugins.hook_registry"), "HookRegistry"),
        extra_buffer_gate=_extra_buffer_gate(),
        extra_buffer_gate_method=_extra_buffer_gate_method(),
        tree_class=_tree_class(),
        mamba_used_gauge=_mamba_used_gauge(),
        flags=flags,
        choices=choices,
        pd_transfer_refusal=_pd_transfer_refusal(),
        missing_hook_targets=_unresolved(_fault_hook_targets()),
        paged_alloc_triton_only=_paged_alloc_triton_only(),
        tree_cores=tuple(getattr(_module("sglang.srt.mem_cache.unified_cache.tree_core_registry"), "_TREE_CORE_REGISTRY", None) or ()),
        mamba2_track_floor=MAMBA2_TRACK_FLOOR in _class_source("sglang.srt.layers.attention.hybrid_linear_attn_backend", "Mamba2AttnBackend"),
        think_end_single_token=THINK_END_SINGLE in _class_source("sglang.srt.constrained.reasoner_grammar_backend", "ReasonerGrammarBackend"),
        test_switches=_test_switches(),
        hicache_branching_skipped=_hicache_branching_skipped(),
    )


def _hicache_branching_skipped() -> str | None:
    """SGLang's comment where the unified tree's Mamba component fills branching states only
    without a cache controller, when that tree serves a hybrid model's HiCache (the release
    has the radix-cache registry; 0.5.12 builds HiMambaRadixCache instead); None otherwise."""
    registry = _module("sglang.srt.mem_cache.registry")
    factory = getattr(registry, "default_radix_cache_factory", None)
    component = getattr(_module("sglang.srt.mem_cache.unified_cache_components.mamba_component"), "MambaComponent", None)
    finalize = getattr(component, "finalize_match_result", None)
    if factory is None or finalize is None:
        return None
    lines = inspect.getsource(finalize).splitlines()
    at = next((i for i, ln in enumerate(lines) if "cache_controller is None" in ln), None)
    if at is None:
        return None
    above = []
    for ln in reversed(lines[:at]):
        if not ln.strip().startswith("#"):
            break
        above.insert(0, ln.strip().lstrip("#").strip())
    return f"MambaComponent.finalize_match_result: {' '.join(above) or lines[at].strip()}"


#: SGLang's own words for the two start-up refusals read from its source (not imported: the
#: backends import kernels a CPU probe need not load).
MAMBA2_TRACK_FLOOR = "must be >= mamba_chunk_size"
THINK_END_SINGLE = "must encode to exactly one token"


def _class_source(module: str, cls: str) -> str:
    """The text of class ``cls`` in ``module``'s file, read without importing it ('' when absent)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return ""
    with open(spec.origin, encoding="utf-8", errors="replace") as f:
        text = f.read()
    start = text.find(f"\nclass {cls}(")
    if start < 0:
        return ""
    end = text.find("\nclass ", start + 1)
    return text[start:] if end < 0 else text[start:end]


#: The prefix of SGLang's own test switches (``SGLANG_TEST_RETRACT``, ``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL``, ...).
TEST_SWITCH_PREFIX = "SGLANG_TEST_"


def _test_switches() -> tuple[str, ...]:
    """The ``SGLANG_TEST_*`` switches ``sglang.srt.environ.Envs`` declares (a release without
    ``Envs`` declares none: empty, and nothing is judged from it)."""
    envs = getattr(_module("sglang.srt.environ"), "Envs", None)
    return tuple(sorted(n for n in dir(envs) if n.startswith(TEST_SWITCH_PREFIX))) if envs is not None else ()


#: The Triton kernel SGLang's paged KV allocator launches for a prefill (page size > 1).
PAGED_ALLOC_KERNEL = "alloc_extend_kernel"


def _paged_alloc_triton_only() -> bool:
    """SGLang's paged allocator launches ``alloc_extend_kernel`` unconditionally (up to 0.5.22:
    no device question a platform answers), so page sizes above 1 need Triton's CPU
    interpreter here (``SGLangCpuTarget.env``).  0.5.23 asks
    ``current_platform.capabilities.supports_triton`` and has a torch path."""
    paged = _module("sglang.srt.mem_cache.allocator.paged") or _module("sglang.srt.mem_cache.allocator")
    cls = getattr(paged, "PagedTokenToKVPoolAllocator", None)
    try:
        source = inspect.getsource(cls.alloc_extend)
    except (AttributeError, OSError, TypeError):
        return False
    return f"{PAGED_ALLOC_KERNEL}[" in source and "use_triton_kernels" not in source


def _cache_file():
    """Where this installation's answers are kept: keyed by this module's code and the
    installed sglang and transformers distributions (their files' paths, versions and
    RECORD times), so any reinstall or edit probes again.  None when sglang is absent."""
    import hashlib
    import importlib.metadata as md
    import os
    import tempfile
    from pathlib import Path

    # the parser flags asked come from conformance.matrix.axes too: a new axis value probes again
    parts = [Path(__file__).read_text(), *_fault_hook_targets(), *PARSER_FLAGS]
    for name in ("sglang", "transformers"):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            return None
        record = Path(str(dist.locate_file(""))) / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.dist-info" / "RECORD"
        parts += [name, dist.version, str(dist.locate_file("")), str(record.stat().st_mtime_ns) if record.exists() else "-"]
    for name in MOONCAKE_DISTS:  # the PD transfer engine's answer changes when Mooncake is (un)installed
        try:
            parts += [name, md.version(name)]
        except md.PackageNotFoundError:
            parts += [name, "-"]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    root = Path(os.environ.get("HYBRID_CONFORMANCE_PROBE_CACHE") or Path(tempfile.gettempdir()) / "hybrid-conformance-probes")
    return root / f"{key}.json"


@functools.lru_cache(maxsize=1)
def probe() -> Features:
    """Probe the installed SGLang once (imports it: 10-60 s); a successful probe is kept
    for this exact installation (``_cache_file``), so later processes answer at once."""
    import json
    import logging
    import warnings

    cache = _cache_file()
    data = json.loads(cache.read_text()) if cache is not None and cache.exists() else None
    if data is not None and data.get("test_switches") is not None:  # a cache from before a probe was added is probed again
        return Features(**{**data, "strategies": tuple(data["strategies"]), "flags": tuple(data.get("flags", ())),
                           "choices": tuple((f, tuple(c)) for f, c in data.get("choices", ())),
                           "missing_hook_targets": tuple(tuple(m) for m in data.get("missing_hook_targets", ())),
                           "tree_cores": tuple(data["tree_cores"]), "test_switches": tuple(data["test_switches"])})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        features = _probe()
    for name in ("sglang", "sglang.srt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if cache is not None and features.importable:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps({f.name: getattr(features, f.name) for f in fields(features)}))
        tmp.replace(cache)
    return features


def main() -> None:  # python -m conformance.sglang_api.probes
    import json
    import sys

    f = probe()
    print(json.dumps(f.as_dict()) if "--json" in sys.argv else f.summary())


if __name__ == "__main__":  # pragma: no cover
    main()
