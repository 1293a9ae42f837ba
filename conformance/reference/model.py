"""Runtime interface of the tiny twins, the models the reference engine serves.

``load_twin(name)`` gives a ``Twin``: a transformers model (float32, eager attention and
experts) plus tokenizer and metadata.  ``Twin.extend(state, ids)`` is a pure function of
(prefix state, new tokens): it returns float32 next-token log-probs, one row per new token,
and a new ``TwinState``; the input state is never mutated.  A state is the contents of
transformers' own ``DynamicCache`` for the model (attention KV for ``seq_len`` tokens, conv
and SSM states of the recurrent layers, float32).  Extending in pieces equals one extend
and token-by-token decode within 1e-5 on log-probs (measured <= 8e-6; the float32 ulp at
log-probs of -32..-64 is 3.8e-6; tests/test_twins_model.py).  ``extend`` holds a per-twin
lock (it hooks the final norm), so threads may share a twin but run one at a time.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from conformance.errors import KitError
from conformance.reference import twins
from conformance.reference.tokenizer import TwinTokenizer
from conformance.reference.twin_init import is_gated_delta_net, is_mamba2_mixer

FINAL_NORM_NAMES = ("norm", "norm_f", "final_layernorm")  # Qwen3-Next/Granite, Nemotron-H, Falcon-H1


def known_twins() -> list[str]:
    """Names ``load_twin`` accepts (one per fixtures/models/<name>/twin.toml)."""
    return twins.known_twins()


class TwinState:
    """The prefix a twin has consumed: ``seq_len`` tokens, held as a DynamicCache."""

    def __init__(self, cache, seq_len: int, recurrent: tuple[int, ...], slot_nbytes: int) -> None:
        self.cache = cache
        self.seq_len = seq_len
        self._recurrent = recurrent
        self._slot_nbytes = slot_nbytes

    def __repr__(self) -> str:
        return f"TwinState(seq_len={self.seq_len}, recurrent_layers={list(self._recurrent)})"

    def clone(self) -> "TwinState":
        """A deep copy sharing no tensor with this state."""
        return TwinState(copy.deepcopy(self.cache), self.seq_len, self._recurrent, self._slot_nbytes)

    def recurrent_layers(self) -> list[int]:
        """Indices of the layers that hold a recurrent (conv + SSM) state."""
        return list(self._recurrent)

    def _layer(self, layer: int):
        if layer not in self._recurrent:
            raise KitError(f"layer {layer} holds no recurrent state; recurrent layers: {list(self._recurrent)}")
        return self.cache.layers[layer]

    def _tensors(self, layer: int, table: str) -> list[torch.Tensor]:
        states = getattr(self._layer(layer), table)
        if isinstance(states, torch.Tensor):  # transformers before 5.12 keeps one tensor per layer
            return [states]
        return [t for t in states.values() if t is not None]

    def scale_recurrent(self, layer: int, factor: float) -> "TwinState":
        """A copy whose SSM (recurrent) state of ``layer`` is multiplied by ``factor``."""
        out = self.clone()
        for t in out._tensors(layer, "recurrent_states"):
            t.mul_(factor)
        return out

    def zero_recurrent(self) -> "TwinState":
        """A copy whose conv and SSM states are all zero (attention KV kept)."""
        out = self.clone()
        for layer in self._recurrent:
            for table in ("conv_states", "recurrent_states"):
                for t in out._tensors(layer, table):
                    t.zero_()
        return out

    def with_recurrent_from(self, other: "TwinState") -> "TwinState":
        """A copy with this state's attention KV and ``other``'s conv and SSM states.

        Models a misplaced snapshot, e.g. the recurrent state of one token earlier.
        """
        out = self.clone()
        for layer in self._recurrent:
            mine, theirs = out.cache.layers[layer], other.cache.layers[layer]
            for table in ("conv_states", "recurrent_states"):
                source = getattr(theirs, table)
                getattr(mine, table).update({k: None if v is None else v.clone() for k, v in source.items()})
            for flag in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state"):
                getattr(mine, flag).update(getattr(theirs, flag))
        return out

    def nbytes_recurrent(self) -> int:
        """Bytes of conv + SSM state one sequence holds (the size of one mamba slot)."""
        return self._slot_nbytes


class Twin:
    """A loaded tiny twin: model, tokenizer, metadata and the pure ``extend`` function."""

    def __init__(self, spec: twins.TwinSpec, path: Path, model, tokenizer: TwinTokenizer) -> None:
        self.spec = spec
        self.name = spec.name
        self.family = spec.family
        self.path = path
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.max_context = spec.max_context
        self.mamba_chunk_size = spec.mamba_chunk_size
        self._recurrent = tuple(
            i for i, layer in enumerate(model.model.layers)
            if any(is_gated_delta_net(m) or is_mamba2_mixer(m) for m in layer.modules())
        )
        self._final_norm, self._norm_eps, self._head_weight = _float64_head(model)
        self._lock = threading.Lock()
        self._slot_nbytes = 0
        self._slot_nbytes = self._measure_slot_nbytes()

    def __repr__(self) -> str:
        return f"Twin({self.name!r}, family={self.family!r}, path={str(self.path)!r})"

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def empty_state(self) -> TwinState:
        """The state of the empty prefix (seq_len 0)."""
        return TwinState(self._new_cache(), 0, self._recurrent, self._slot_nbytes)

    def _measure_slot_nbytes(self) -> int:
        _, state = self.extend(self.empty_state(), [self.pad_token_id])
        total = 0
        for layer in self._recurrent:
            for table in ("conv_states", "recurrent_states"):
                total += sum(t.numel() * t.element_size() for t in state._tensors(layer, table))
        return total

    def _check_ids(self, state: TwinState, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise KitError(f"{self.name}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if state.seq_len + len(ids) > self.max_context:
            raise KitError(
                f"{self.name}: {state.seq_len} + {len(ids)} tokens exceed max_context {self.max_context}")
        return ids

    def extend(self, state: TwinState, token_ids: Sequence[int], keep: int | None = None) -> tuple[torch.Tensor, TwinState]:
        """Run ``token_ids`` after the prefix ``state`` holds.

        Returns float32 log-probs of shape (len(token_ids), vocab) -- row i is the
        next-token distribution after token_ids[i] -- and the new state.  With ``keep``,
        only the last ``keep`` rows are computed (the float64 head over a 32k vocabulary
        dominates a long prefill otherwise).  ``state`` is not mutated.  No grad.
        """
        ids = self._check_ids(state, token_ids)
        if not ids:
            return torch.empty(0, self.vocab_size, dtype=torch.float32), state.clone()
        cache = copy.deepcopy(state.cache)
        start, n = state.seq_len, len(ids)
        captured: list[torch.Tensor] = []
        with self._lock:
            hook = self._final_norm.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
            try:
                with torch.no_grad():
                    out = self.model.model(
                        input_ids=torch.tensor([ids], dtype=torch.long),
                        attention_mask=torch.ones(1, start + n, dtype=torch.long),
                        position_ids=torch.arange(start, start + n, dtype=torch.long)[None],
                        past_key_values=cache,
                        use_cache=True,
                    )
                    prenorm = captured.pop()[0]
                    logprobs = self._head_logprobs(prenorm if keep is None else prenorm[max(n - keep, 0):])
            finally:
                hook.remove()
        return logprobs, TwinState(out.past_key_values, start + n, self._recurrent, self._slot_nbytes)

    def _head_logprobs(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm, LM head and log-softmax in float64, returned as float32.

        The sharpened head puts logits at |l| ~ 20-40, where one float32 ulp is 2-4e-6,
        so a float32 head alone makes batch shapes differ by ~1e-5; in float64 the
        split/decode paths agree to the float32 trunk's own ~3e-8 relative error.
        """
        x = prenorm.to(torch.float64)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._norm_eps)
        logits = torch.nn.functional.linear(x, self._head_weight)
        return torch.log_softmax(logits, dim=-1).to(torch.float32)


def _float64_head(model) -> tuple[torch.nn.Module, float, torch.Tensor]:
    """(final norm module, its eps, LM head weight with the norm weight and the model's
    logit multipliers folded in, float64), replicating each family's own head."""
    norm = next(getattr(model.model, a) for a in FINAL_NORM_NAMES if hasattr(model.model, a))
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    gain = norm.weight.detach().to(torch.float64)
    if type(norm).__name__ == "Qwen3NextRMSNorm":  # stores weight - 1 (zero-centred)
        gain = 1.0 + gain
    # FalconH1 multiplies logits by lm_head_multiplier; GraniteMoeHybrid divides by logits_scaling.
    scale = float(getattr(model.config, "lm_head_multiplier", 1.0)) / float(
        getattr(model.config, "logits_scaling", 1.0))
    weight = model.get_output_embeddings().weight.detach().to(torch.float64) * gain[None, :] * scale
    return norm, eps, weight


def _load_model(path: Path, architecture: str):
    import transformers

    transformers.logging.set_verbosity_error()  # silence "kernel not installed, using PyTorch" notes
    transformers.logging.disable_progress_bar()
    model_cls = getattr(transformers, architecture)
    model = model_cls.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    return model.eval()


def load_twin(name: str) -> Twin:
    """The twin ``name``: generated on first use (fixed seed), then loaded from the cache."""
    spec = twins.load_spec(name)
    path = twins.ensure_twin(name)
    model = _load_model(path, spec.architecture)
    return Twin(spec, path, model, TwinTokenizer(path))


