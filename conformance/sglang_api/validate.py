"""CLI validation through the installed SGLang's own parser, on CPU, on any release.

``validate_args(args, config=...)`` runs ``prepare_server_args`` (and ``resolve_once()``
where the release has it, inside ``override_platform(is_cuda=True)`` where it has that:
the CPU platform refuses the extra-buffer strategies otherwise) with the model path
swapped for a config.json-only folder, the device forced to CPU and the tokenizer
skipped, so nothing is loaded.  Older releases validate inside ``__post_init__``.

Outcomes (:class:`Validation.status`): ``ok``; ``refused`` with SGLang's own first line;
``na`` when the command asks for a strategy the release predates, or one it does not
yet offer for the model's architecture (the release's own refusal line is the reason).  Granite configs are rewritten to the layer-type spelling
the release reads (``mamba``/``attention`` before it took ``linear_attention``/
``full_attention``), decided by the probe, never by a version number.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from conformance.sglang_api import probes

GRANITE_LEGACY_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


@dataclass(frozen=True)
class Validation:
    ok: bool
    message: str
    resolved_chunk: int | None = None
    resolved_strategy: str | None = None
    status: str = ""  # ok | refused | na (derived from ok when empty)
    radix_cache_disabled: bool = False  # SGLang resolved disable_radix_cache=True

    def __post_init__(self):
        if not self.status:
            object.__setattr__(self, "status", "ok" if self.ok else "refused")


def config_for_release(folder: Path, features: probes.Features | None = None, *, serving: bool = False) -> Path:
    """``folder``, or a config.json-only copy spelled the way the installed release reads it;
    ``serving``: the copy also links every other file of ``folder`` (weights, tokenizer), so a
    server can load it (the sglang-cpu target on a release before the new granite names)."""
    features = features or probes.probe()
    cfg_path = Path(folder) / "config.json"
    if features.granite_new_layer_names or not cfg_path.exists():
        return Path(folder)
    cfg = json.loads(cfg_path.read_text())
    types = cfg.get("layer_types")
    if cfg.get("model_type") != "granitemoehybrid" or not types or not set(types) & set(GRANITE_LEGACY_NAMES):
        return Path(folder)
    cfg["layer_types"] = [GRANITE_LEGACY_NAMES.get(t, t) for t in types]
    text = json.dumps(cfg, indent=1, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    root = Path(os.environ.get("HYBRID_CONFORMANCE_POOL_CACHE", Path(tempfile.gettempdir()) / "hybrid-conformance-pool"))
    out = root / "configs" / f"{Path(folder).name}-legacy-layer-names-{digest}{'-served' if serving else ''}"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for other in sorted(Path(folder).iterdir()) if serving else ():
            if other.name != "config.json":
                with contextlib.suppress(FileExistsError):  # a concurrent start linked it first
                    (out / other.name).symlink_to(other.resolve())
        tmp = out / f"config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(out / "config.json")
    return out


def _option(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _strategy_na(args: Sequence[str], features: probes.Features) -> Validation | None:
    """n/a when the command names a strategy (or strategy flag) the release predates."""
    for flag in (probes.NEW_STRATEGY_FLAG, probes.OLD_STRATEGY_FLAG):
        value = _option(args, flag)
        if value is None:
            continue
        if flag != features.strategy_flag:
            return Validation(False, f"sglang {features.version} has no {flag} (it takes {features.strategy_flag})", status="na")
        reason = features.not_applicable(value)
        if reason is None:
            return None
        return Validation(False, _parser_refusal(args) or reason, status="na")
    return None


def _parser_refusal(args: Sequence[str]) -> str | None:
    """SGLang's parser's own error line for ``args`` (argparse prints it and exits)."""
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            prepare_server_args(list(args))
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        return lines[-1].split("error:", 1)[1].strip() if lines else None
    except Exception:
        return None
    return None


def _resolved_chunk(sa: object) -> int | None:
    try:
        from sglang.srt.arg_groups.overrides import mamba_cache_chunk_size  # 0.5.19+

        return int(mamba_cache_chunk_size(sa))
    except Exception:
        pass
    try:
        value = getattr(sa, "mamba_cache_chunk_size", None)  # a property on older ServerArgs
        return int(value) if value is not None else getattr(sa, "_mamba_cache_chunk_size", None)
    except Exception:
        return getattr(sa, "_mamba_cache_chunk_size", None)


def _resolved_strategy(sa: object) -> str | None:
    resolved = sa.resolved_dict() if hasattr(sa, "resolved_dict") else vars(sa)
    for name in ("mamba_radix_cache_strategy", "mamba_scheduler_strategy"):
        if resolved.get(name) is not None:
            return resolved[name]
    return None


def validate_args(args: Sequence[str], *, config: Path | None = None) -> Validation:
    """Run SGLang's own parser and resolution on CPU; SGLang's message on refusal.

    ``args`` are the arguments after the launcher; ``config`` replaces ``--model-path``.
    """
    features = probes.probe()
    if not features.importable:
        return Validation(False, f"sglang {features.version} is not importable: {features.import_error}")
    local = list(args)
    if config is not None:
        i = local.index("--model-path")
        local[i + 1] = str(config_for_release(config, features))
    local = _drop_option(local, "--tp-size")  # resolution on CPU cannot see GPUs
    local = _drop_option(local, "--port") + ["--port", "30000"]  # plan ports are placeholders (older releases derive others from it)
    local += ["--device", "cpu", "--skip-tokenizer-init"]
    na = _strategy_na(local, features)
    if na is not None:
        return na
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with as_cuda(features), contextlib.redirect_stderr(err):
            sa = prepare_server_args(local)
        with as_cuda(features):
            if hasattr(sa, "resolve_once"):
                sa.resolve_once()
            strategy, chunk = _resolved_strategy(sa), _resolved_chunk(sa)
            no_radix = bool((sa.resolved_dict() if hasattr(sa, "resolved_dict") else vars(sa)).get("disable_radix_cache"))
    except SystemExit as e:  # argparse refusing an unknown flag
        lines = [ln.split("error:", 1)[1].strip() for ln in err.getvalue().splitlines() if "error:" in ln]
        return Validation(False, f"SGLang's parser rejected the arguments: {lines[-1] if lines else f'exit {e.code}'}")
    except Exception as e:  # SGLang raises AssertionError/ValueError with its own message
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        line = f"{type(e).__name__}: {msg}"
        if UNSUPPORTED_FOR_MODEL.search(msg):  # the release predates the strategy for this architecture
            return Validation(False, line, status="na")
        return Validation(False, line)
    return Validation(True, "ok", chunk, strategy, radix_cache_disabled=no_radix)


# SGLang's own wording when a strategy exists but not yet for the model's architecture
# ("mamba extra_buffer is not supported for NemotronHForCausalLM model", 0.5.12 and older;
# "extra_buffer is not supported for X; use no_buffer." from 0.5.15).
UNSUPPORTED_FOR_MODEL = re.compile(r"is not supported for \w+(?: model|; use no_buffer)")


@contextlib.contextmanager
def as_cuda(features: probes.Features) -> Iterator[None]:
    """Resolve as a CUDA server would: ``override_platform(is_cuda=True)`` where the release
    has it; before that (``is_cuda`` looked up in ``server_args``'s namespace) the same
    answer given for the duration of the call."""
    if features.override_platform:
        from sglang.srt.runtime_context import override_platform

        with override_platform(is_cuda=True):
            yield
        return
    import sglang.srt.server_args as server_args

    original = getattr(server_args, "is_cuda", None)
    if original is None:
        yield
        return
    server_args.is_cuda = lambda: True
    try:
        yield
    finally:
        server_args.is_cuda = original


def _drop_option(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out
