"""The "toy" model: a deterministic tiny recurrent + attention LM for fast engine tests.

It implements the same runtime interface as the tiny twins (``conformance.reference.model``):
``extend(state, token_ids) -> (logprobs, new_state)`` with float32 log-probs, one row per
input token, and a ``TwinState`` style state holding both per-token keys/values (the
attention layer's KV) and a fixed-size recurrent state per recurrent layer (the part a
mamba slot holds).  Weights come from a fixed seed, so every process builds the same model.
The outputs are path independent: extending in pieces gives the rows of one extend.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import torch

TOY_NAME = "toy"
_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?-+=*/()'\"\n#"
_SPECIALS = 3  # 0 pad, 1 eos, 2 bos


class ToyTokenizer:
    """Character tokenizer over a fixed alphabet; unknown characters map to '?'."""

    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = 2

    def __init__(self) -> None:
        self.vocab_size = _SPECIALS + len(_ALPHABET)
        self._ids = {c: i + _SPECIALS for i, c in enumerate(_ALPHABET)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        unknown = self._ids["?"]
        return [self._ids.get(c, unknown) for c in text.lower()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < _SPECIALS:
                if not skip_special_tokens:
                    out.append(("<pad>", "<eos>", "<bos>")[i])
                continue
            out.append(_ALPHABET[i - _SPECIALS] if i - _SPECIALS < len(_ALPHABET) else "?")
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, **_):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text


@dataclass
class ToyState:
    """Keys/values of the attention layer plus one recurrent vector per recurrent layer."""

    keys: torch.Tensor
    values: torch.Tensor
    recurrent: list[torch.Tensor] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return int(self.keys.shape[0])

    def clone(self) -> "ToyState":
        return ToyState(self.keys.clone(), self.values.clone(), [h.clone() for h in self.recurrent])

    def recurrent_layers(self) -> list[int]:
        return list(range(len(self.recurrent)))

    def scale_recurrent(self, layer: int, factor: float) -> "ToyState":
        """A copy with recurrent layer ``layer`` multiplied by ``factor``."""
        out = self.clone()
        out.recurrent[layer].mul_(factor)
        return out

    def zero_recurrent(self) -> "ToyState":
        """A copy with every recurrent state zeroed (attention KV kept)."""
        out = self.clone()
        for h in out.recurrent:
            h.zero_()
        return out

    def with_recurrent_from(self, other: "ToyState") -> "ToyState":
        """A copy with this state's KV and ``other``'s recurrent states."""
        return ToyState(self.keys.clone(), self.values.clone(), [h.clone() for h in other.recurrent])

    def nbytes_recurrent(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.recurrent)


class ToyModel:
    """Two diagonal linear recurrences and one causal attention layer, d=32, vocab 59."""

    name = TOY_NAME
    family = "toy"
    max_context = 4096
    mamba_chunk_size = 64

    def __init__(self, hidden: int = 32, recurrent_layers: int = 2, seed: int = 1234) -> None:
        self.tokenizer = ToyTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        gen = torch.Generator().manual_seed(seed)
        d = hidden
        self.hidden = d
        self.embed = torch.randn(self.vocab_size, d, generator=gen) * 0.8
        # layer 0 remembers long (like an SSM state), the others forget fast
        self.decay = [torch.rand(d, generator=gen) * (0.03 if i == 0 else 0.5) + (0.965 if i == 0 else 0.45)
                      for i in range(recurrent_layers)]
        self.inp = [torch.randn(d, d, generator=gen) / d**0.5 for _ in range(recurrent_layers)]
        self.wq = torch.randn(d, d, generator=gen) / d**0.5
        self.wk = torch.randn(d, d, generator=gen) / d**0.5
        self.wv = torch.randn(d, d, generator=gen) / d**0.5
        self.out = torch.randn(d, self.vocab_size, generator=gen) * 1.5 / d**0.5

    def empty_state(self) -> ToyState:
        d = self.hidden
        return ToyState(torch.zeros(0, d), torch.zeros(0, d), [torch.zeros(d) for _ in self.decay])

    @torch.no_grad()
    def extend(self, state: ToyState, token_ids, keep: int | None = None) -> tuple[torch.Tensor, ToyState]:
        """Log-probs (len(token_ids), vocab) -- only the last ``keep`` rows when given -- and the
        state after token_ids; ``state`` is untouched."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.numel() == 0:
            return torch.zeros(0, self.vocab_size), state.clone()
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        x = self.embed[ids]
        hidden = x.clone()
        new_rec = []
        for layer, (a, w) in enumerate(zip(self.decay, self.inp)):
            u = torch.tanh(x @ w)
            rows, h = _linear_scan(a, (1 - a) * u, state.recurrent[layer])
            new_rec.append(h)
            hidden = hidden + rows
        q = hidden @ self.wq
        keys = torch.cat([state.keys, hidden @ self.wk])
        values = torch.cat([state.values, hidden @ self.wv])
        start = state.seq_len
        scores = (q @ keys.T) / self.hidden**0.5
        pos_q = torch.arange(start, start + ids.numel()).unsqueeze(1)
        pos_k = torch.arange(keys.shape[0]).unsqueeze(0)
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        attended = torch.softmax(scores, dim=-1) @ values
        logits = (hidden + attended) @ self.out
        rows = torch.log_softmax(logits.float(), dim=-1)
        return (rows if keep is None else rows[-keep:]), ToyState(keys, values, new_rec)


def _linear_scan(decay: torch.Tensor, inputs: torch.Tensor, h0: torch.Tensor, chunk: int = 32):
    """h_t = decay * h_{t-1} + inputs_t for every t, in chunks of closed-form sums."""
    steps = torch.arange(chunk, dtype=torch.float32)
    log_a = torch.log(decay)
    out, h = [], h0
    for begin in range(0, inputs.shape[0], chunk):
        b = inputs[begin:begin + chunk]
        n = b.shape[0]
        lag = (steps[:n, None] - steps[None, :n]).unsqueeze(-1)  # (t, s, 1)
        weights = torch.exp(lag.clamp(min=0) * log_a) * (lag >= 0)
        rows = torch.einsum("tsd,sd->td", weights, b) + torch.exp((steps[:n, None] + 1) * log_a) * h
        out.append(rows)
        h = rows[-1]
    return torch.cat(out), h.clone()


def load_toy() -> ToyModel:
    return ToyModel()
