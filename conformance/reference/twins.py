"""Tiny-twin specs (fixtures/models/<twin>/twin.toml), deterministic generation, cache.

A spec names the transformers class, its config kwargs, extra config.json keys SGLang's
parser needs, an init recipe (``twin_init``) and a seed.  ``ensure_twin(name)`` builds
the model with transformers' own class from the seed, applies the recipe, and saves an
HF folder (config.json, model.safetensors, tokenizer) into the cache,
``$HYBRID_CONFORMANCE_TWIN_CACHE`` or ``~/.cache/hybrid-conformance/twins``, under
``<name>-<spec hash>``.  The folder appears atomically (written aside, then renamed), so
concurrent first uses are safe.  Weights are never committed nor downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.errors import KitError
from conformance.reference.tokenizer import tokenizer_fingerprint
from conformance.reference.tokenizer import save_tokenizer

GENERATOR_VERSION = 1  # bump when generation code changes the weights for the same spec
TWIN_DIR = Path(os.environ.get(
    "HYBRID_CONFORMANCE_TWIN_SPECS", Path(__file__).resolve().parents[2] / "fixtures" / "models"))
SPEC_FILE = "twin.toml"
RECORDED_TABLE = "[recorded]"
CACHE_ENV = "HYBRID_CONFORMANCE_TWIN_CACHE"
ARCHITECTURES = {  # architecture -> transformers config class name
    "Qwen3NextForCausalLM": "Qwen3NextConfig",
    "NemotronHForCausalLM": "NemotronHConfig",
    "GraniteMoeHybridForCausalLM": "GraniteMoeHybridConfig",
    "FalconH1ForCausalLM": "FalconH1Config",
}
_SEEDED_INIT = threading.Lock()
_SPEC_KEYS = {"name", "family", "architecture", "seed", "max_context", "mamba_chunk_size",
              "config", "sglang_config", "init", "recorded"}


@dataclass(frozen=True)
class TwinSpec:
    """One twin.toml: what to build (hashed) plus the recorded measurements (not hashed)."""

    name: str
    family: str
    architecture: str
    seed: int
    max_context: int
    mamba_chunk_size: int
    config: dict[str, Any]
    sglang_config: dict[str, Any]
    init: dict[str, Any]
    recorded: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    def hashed_fields(self) -> dict[str, Any]:
        return {
            "generator": GENERATOR_VERSION, "tokenizer": tokenizer_fingerprint(), "name": self.name, "family": self.family,
            "architecture": self.architecture, "seed": self.seed, "max_context": self.max_context,
            "mamba_chunk_size": self.mamba_chunk_size, "config": self.config,
            "sglang_config": self.sglang_config, "init": self.init,
        }

    @property
    def spec_hash(self) -> str:
        blob = json.dumps(self.hashed_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def known_twins() -> list[str]:
    """Names of every twin with a spec under fixtures/models/."""
    if not TWIN_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in TWIN_DIR.glob(f"*/{SPEC_FILE}"))


def load_spec(name: str) -> TwinSpec:
    """Parse and check fixtures/models/<name>/twin.toml; KitError (one line) if bad."""
    path = TWIN_DIR / name / SPEC_FILE
    if not path.is_file():
        raise KitError(f"unknown twin {name!r}; known twins: {', '.join(known_twins()) or '(none)'}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise KitError(f"{path}: invalid TOML: {err}") from None
    unknown = set(data) - _SPEC_KEYS
    if unknown:
        raise KitError(f"{path}: unknown keys {sorted(unknown)}")
    if data.get("name") != name:
        raise KitError(f"{path}: name {data.get('name')!r} does not match its folder {name!r}")
    if data.get("architecture") not in ARCHITECTURES:
        raise KitError(f"{path}: architecture must be one of {sorted(ARCHITECTURES)}")
    try:
        return TwinSpec(
            name=name, family=str(data["family"]), architecture=data["architecture"],
            seed=int(data["seed"]), max_context=int(data["max_context"]),
            mamba_chunk_size=int(data["mamba_chunk_size"]), config=dict(data["config"]),
            sglang_config=dict(data.get("sglang_config", {})), init=dict(data["init"]),
            recorded=dict(data.get("recorded", {})), source=path,
        )
    except KeyError as err:
        raise KitError(f"{path}: missing key {err}") from None


def cache_root() -> Path:
    """Where generated twins live (env HYBRID_CONFORMANCE_TWIN_CACHE overrides)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybrid-conformance" / "twins"


def twin_folder(spec: TwinSpec) -> Path:
    return cache_root() / f"{spec.name}-{spec.spec_hash}"


def build_config(spec: TwinSpec):
    """The transformers config object of ``spec``."""
    import transformers

    config_cls = getattr(transformers, ARCHITECTURES[spec.architecture])
    config = config_cls(**spec.config)
    config.architectures = [spec.architecture]
    return config


def build_model(spec: TwinSpec):
    """A freshly generated float32 model: seeded transformers init + the spec's recipe."""
    import torch
    import transformers

    from conformance.reference.twin_init import apply_init_recipe  # deferred: imports torch; only building a twin needs it

    config = build_config(spec)
    model_cls = getattr(transformers, spec.architecture)
    with _SEEDED_INIT, torch.random.fork_rng(devices=[]):  # the global RNG: one thread at a time
        torch.manual_seed(spec.seed)
        model = model_cls(config).to(torch.float32).eval()
    apply_init_recipe(model, spec.init)
    return model


def _write_sglang_keys(folder: Path, spec: TwinSpec) -> None:
    """config.json as transformers wrote it, plus the keys SGLang 0.5.23's parser needs."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(spec.sglang_config)
    if spec.family == "nemotron-h":
        # transformers writes its own layer-type names; SGLang accepts only its pattern names.
        config["layers_block_type"] = list(spec.config["layers_block_type"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


#: Checkpoint key names as the family's published checkpoints spell them, where some
#: transformers release writes them otherwise: transformers 5.8.1 (the pin of SGLang
#: 0.5.13-0.5.17's venvs) saves Nemotron-H's embedding as ``backbone.embedding.weight``
#: (huggingface/transformers PR 48075), which SGLang's Nemotron-H loader skips ("Parameter
#: model.embedding.weight not found in params_dict": an uninitialised embedding, garbage
#: from the first token) and transformers 5.19 reports missing.  The twin's folder must not
#: depend on which environment happened to write it first.
PUBLISHED_KEYS: dict[str, dict[str, str]] = {
    "nemotron-h": {"backbone.embedding.weight": "backbone.embeddings.weight"},
}
CHECKPOINT = "model.safetensors"


def off_layout_keys(folder: Path, family: str) -> list[str]:
    """The checkpoint keys of a twin folder that are not spelled as published (none: fine)."""
    renames = PUBLISHED_KEYS.get(family)
    path = folder / CHECKPOINT
    if not renames or not path.is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sorted(k for k in f.keys() if k in renames)


def _publish_layout(folder: Path, family: str) -> None:
    """Rename the keys this transformers wrote off the published layout (in place)."""
    if not off_layout_keys(folder, family):
        return
    from safetensors.torch import load_file, save_file

    path = folder / CHECKPOINT
    renames = PUBLISHED_KEYS[family]
    tensors = {renames.get(k, k): v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def generate(spec: TwinSpec, dest: Path) -> None:
    """Write the full HF folder of ``spec`` into ``dest`` (which must not exist yet)."""
    import transformers

    transformers.logging.disable_progress_bar()
    model = build_model(spec)
    dest.mkdir(parents=True)
    model.save_pretrained(dest, safe_serialization=True)
    _publish_layout(dest, spec.family)
    _write_sglang_keys(dest, spec)
    save_tokenizer(dest, vocab_size=spec.config["vocab_size"], max_context=spec.max_context)
    (dest / "twin.json").write_text(json.dumps(
        {"spec_hash": spec.spec_hash, **spec.hashed_fields()}, indent=2, sort_keys=True) + "\n")


def ensure_twin(name: str, force: bool = False) -> Path:
    """The twin's HF folder, generating it (atomically) on first use or when ``force``."""
    spec = load_spec(name)
    folder = twin_folder(spec)
    complete = (folder / "twin.json").is_file()  # written last, inside the atomic rename
    if complete and not force and not off_layout_keys(folder, spec.family):
        return folder
    force = force or complete  # a folder written off the published layout is made again
    if folder.exists() and not complete:  # left by hand-editing; never by a crashed run
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        generate(spec, staging / "twin")
        if force and folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(staging / "twin", folder)
        except OSError:
            if not (folder / "twin.json").is_file():  # lost a race to a broken folder
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def make_twins(names: list[str] | None = None, force: bool = False) -> list[Path]:
    """Generate (or find cached) every named twin (default: all); their folders."""
    chosen = list(names) if names else known_twins()
    return [ensure_twin(n, force=force) for n in chosen]
