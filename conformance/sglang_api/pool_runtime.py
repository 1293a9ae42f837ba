"""Global SGLang state for one pool cell: a resolved, published ``ServerArgs``.

The pool tier needs no weights, only SGLang's resolved configuration.  We write a
config.json-only model folder per family (into a cache dir, never into fixtures/), build
``ServerArgs`` with SGLang's own CLI parser, ``resolve_once()`` it inside
``override_platform(is_cuda=True)`` (the CPU platform refuses extra_buffer otherwise) and
``publish`` it, so the chunk size comes from the model config exactly as on a server:
64 (FLA) for Qwen3-Next's gated delta-net, ``mamba_chunk_size`` for Mamba2 families.
Mamba2 families are all represented by a Nemotron-H config carrying the cell's
``mamba_chunk_size``: the pool tier only depends on the chunk size.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conformance.errors import KitError
from conformance.matrix.faults import LAZY_ALLOC_FAIL_ENV
from conformance.matrix.strategy import strategy_named

GDN_FAMILIES = ("qwen3-next",)


@dataclass(frozen=True)
class PoolKey:
    """Everything the pool tier's behaviour depends on; cells equal on it share a harness."""

    strategy: str
    page_size: int
    track_interval: int
    model_chunk: int
    lazy_alloc_fail: bool = False

    @property
    def family(self) -> str:
        return "gdn" if self.model_chunk == 64 else "mamba2"

    @property
    def id(self) -> str:
        fault = "-lazy_alloc_fail" if self.lazy_alloc_fail else ""
        return f"{self.strategy}-p{self.page_size}-t{self.track_interval}-c{self.model_chunk}{fault}"

    @classmethod
    def from_cell(cls, cell) -> "PoolKey":
        env = dict(cell.env)
        unknown = set(env) - {LAZY_ALLOC_FAIL_ENV}
        if unknown:
            raise KitError(f"cell {cell.id}: the pool tier cannot inject env {', '.join(sorted(unknown))}")
        chunk = cell.model.mamba_chunk_size if cell.model.family not in GDN_FAMILIES else 64
        return cls(
            strategy=cell.strategy.name,
            page_size=cell.page_size,
            track_interval=cell.track_interval,
            model_chunk=chunk,
            lazy_alloc_fail=env.get(LAZY_ALLOC_FAIL_ENV, "0") not in ("", "0"),
        )


def _config(family: str, chunk: int) -> dict:
    if family == "gdn":
        return {
            "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 1024,
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64, "full_attention_interval": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "max_position_embeddings": 4096,
        }
    return {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 1024,
        "hidden_size": 128, "num_hidden_layers": 4, "hybrid_override_pattern": "M-M*", "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "mamba_num_heads": 4, "mamba_head_dim": 32,
        "ssm_state_size": 16, "mamba_n_groups": 1, "intermediate_size": 256, "mamba_chunk_size": chunk,
        "max_position_embeddings": 4096,
    }


def model_dir(key: PoolKey) -> Path:
    """A config.json-only folder for the key's family and chunk (written once per cache dir)."""
    root = Path(os.environ.get("HYBRID_CONFORMANCE_POOL_CACHE", Path(tempfile.gettempdir()) / "hybrid-conformance-pool"))
    folder = root / f"{key.family}-c{key.model_chunk}"
    cfg = folder / "config.json"
    text = json.dumps(_config(key.family, key.model_chunk), indent=1, sort_keys=True)
    if not cfg.exists() or cfg.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(cfg)
    return folder


def legacy_argv(key: PoolKey, strategy_flag: str) -> list[str]:
    """SGLang CLI arguments for ``key`` (the strategy flag as the installed release names it)."""
    argv = [
        "--model-path", str(model_dir(key)), "--device", "cpu", "--skip-tokenizer-init",
        strategy_flag, key.strategy, "--page-size", str(key.page_size),
        "--mamba-track-interval", str(key.track_interval),
    ]
    return argv + strategy_named(key.strategy).server_args()


_RESOLVED: dict[PoolKey, object] = {}


def publish_for(api, key: PoolKey):
    """Resolve (once per key and process) and publish ServerArgs for ``key``; returns them."""
    if key in _RESOLVED:
        api.publish(_RESOLVED[key], role="test")
        return _RESOLVED[key]
    argv = legacy_argv(key, "--mamba-radix-cache-strategy")
    try:
        sa = api.prepare_server_args(argv)
        with api.override_platform(is_cuda=True):
            sa.resolve_once()
    except (AssertionError, ValueError) as e:
        raise KitError(f"pool cell {key.id}: SGLang refuses the configuration: {e}") from None
    api.publish(sa, role="test")
    _RESOLVED[key] = sa
    return sa
