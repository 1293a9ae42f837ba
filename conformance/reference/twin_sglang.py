"""SGLang's own view of a twin folder: what `sglang serve --model-path <twin>` would resolve.

Runs SGLang 0.5.23's CLI parsing and config resolution on CPU (no weights loaded):
``prepare_server_args([...])`` then ``resolve_once()`` inside
``override_platform(is_cuda=True)`` (the CPU platform refuses the extra-buffer
strategies), and reads back the resolved mamba cache chunk size, the attention layers and
the mamba state layout SGLang would allocate.  ``mismatches(twin, view)`` lists every
disagreement with the twin as transformers runs it, so the same folder can be served by
real SGLang on a GPU.  Importing SGLang takes ~5-12 s, so this module imports it lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conformance.errors import KitError
from conformance.matrix.strategy import strategy_named


@dataclass(frozen=True)
class SGLangTwinView:
    """What SGLang resolved for one twin folder and strategy."""

    strategy: str
    chunk_size: int
    attention_layers: tuple[int, ...]
    recurrent_layers: tuple[int, ...]
    conv_channels: int
    ssm_shape: tuple[int, ...]  # (heads, head_dim, state) per sequence, float32


def server_argv(path: Path, strategy: str, page_size: int = 1) -> list[str]:
    """The `sglang serve` arguments the kit would use for a twin folder on CPU."""
    argv = ["--model-path", str(path), "--device", "cpu", "--skip-tokenizer-init",
            "--mamba-radix-cache-strategy", strategy, "--page-size", str(page_size)]
    return argv + strategy_named(strategy).server_args()


def sglang_view(path: Path, strategy: str, page_size: int = 1) -> SGLangTwinView:
    """Resolve ``path`` with SGLang's own parser; KitError (one line) if SGLang refuses it."""
    from sglang.srt.arg_groups.overrides import mamba_cache_chunk_size, model_config_of
    from sglang.srt.runtime_context import create_context, override_platform, use_context
    from sglang.srt.server_args import prepare_server_args

    try:
        args = prepare_server_args(server_argv(path, strategy, page_size))
        with override_platform(is_cuda=True):
            args.resolve_once()
            context = create_context(args, role="test")
        hf_config = model_config_of(args).hf_config
        with use_context(context):
            params = hf_config.mamba2_cache_params
        chunk = mamba_cache_chunk_size(args)
    except Exception as err:  # SGLang raises assorted types; report its own message
        message = " ".join(str(err).split())[:300]
        raise KitError(f"SGLang refuses {path.name} ({strategy}): {type(err).__name__}: {message}") from None
    (conv_channels, _kernel_minus_one), = params.shape.conv
    return SGLangTwinView(
        strategy=strategy,
        chunk_size=int(chunk),
        attention_layers=tuple(int(i) for i in hf_config.full_attention_layer_ids),
        recurrent_layers=tuple(int(i) for i in params.layers),
        conv_channels=int(conv_channels),
        ssm_shape=tuple(int(d) for d in params.shape.temporal),
    )


def mismatches(twin, view: SGLangTwinView) -> list[str]:
    """Every way SGLang's view differs from the twin as transformers runs it ([] if none)."""
    problems = []
    if view.chunk_size != twin.mamba_chunk_size:
        problems.append(f"chunk size: SGLang {view.chunk_size}, twin {twin.mamba_chunk_size}")
    ours_recurrent = tuple(twin.empty_state().recurrent_layers())
    if view.recurrent_layers != ours_recurrent:
        problems.append(f"recurrent layers: SGLang {list(view.recurrent_layers)}, twin {list(ours_recurrent)}")
    ours_attention = tuple(
        i for i, layer in enumerate(twin.model.model.layers)
        if any(type(m).__name__.endswith("Attention") for m in layer.modules())  # e.g. NemotronHAttention
    )
    if view.attention_layers != ours_attention:
        problems.append(f"attention layers: SGLang {list(view.attention_layers)}, twin {list(ours_attention)}")
    _, state = twin.extend(twin.empty_state(), [twin.pad_token_id])
    layer = state.cache.layers[ours_recurrent[0]]
    conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
    if view.conv_channels != conv.shape[1]:
        problems.append(f"conv channels: SGLang {view.conv_channels}, twin {conv.shape[1]}")
    if view.ssm_shape != tuple(ssm.shape[1:]):
        problems.append(f"SSM state shape: SGLang {view.ssm_shape}, twin {tuple(ssm.shape[1:])}")
    return problems
