"""The agreement workload: one scripted conversation with the radix cache, sent in the same
order to two servers (real SGLang on CPU and the reference engine).

Steps cover every way the cache is reached: a cold prompt, the same prompt again, a
continuation of prompt + output, a branch inside the first chunk boundary, a batch of
two siblings, a decode that crosses a track boundary and a follow-up that extends it.
Lengths are relative to the cell's chunk and track grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from conformance.recordings import ServedStep
from conformance.client import SGLangClient
from conformance.workloads.prompts import extension, token_prompts
from conformance.workloads.runners import cached_tokens, generate_tokens, output_ids, served_logprobs

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class ScriptStep:
    """One step of the agreement script: its requests (one, or a batch) and the tokens each generates."""

    name: str
    prompts: tuple[Tokens, ...]  # one request, or a batch
    new_tokens: int


def agreement_script(*, chunk: int, grid: int, vocab_size: int, new_tokens: int = 12) -> list:
    """Steps as callables of the previous outputs: ``[(name, build(history) -> ScriptStep)]``."""
    (p,) = token_prompts([2 * chunk + 37], vocab_size=vocab_size, seed=31)
    (q,) = token_prompts([grid - 5], vocab_size=vocab_size, seed=32)
    ext = lambda tag, n=5: extension(n, vocab_size=vocab_size, seed=f"agree:{tag}")  # noqa: E731
    return [
        ("cold", lambda h: ScriptStep("cold", (p,), new_tokens)),
        ("repeat", lambda h: ScriptStep("repeat", (p,), new_tokens)),
        ("continue", lambda h: ScriptStep("continue", (p + h["cold"][0] + ext("c"),), new_tokens)),
        ("branch", lambda h: ScriptStep("branch", (p[: chunk + 10] + ext("b", 9),), new_tokens)),
        ("siblings", lambda h: ScriptStep("siblings", (p + ext("s1"), p + ext("s2")), new_tokens)),
        ("decode_cross", lambda h: ScriptStep("decode_cross", (q,), new_tokens)),
        ("decode_follow", lambda h: ScriptStep("decode_follow", (q + h["decode_cross"][0] + ext("d", 3),), new_tokens)),
    ]


def run_agreement(client: SGLangClient, script: Sequence, *, top_k: int = 5, timeout: float | None = None) -> dict[str, list[ServedStep]]:
    """Flush once, then send the steps in order; per step the answers in batch order."""
    client.flush_cache()
    history: dict[str, list[Tokens]] = {}
    served: dict[str, list[ServedStep]] = {}
    for name, build in script:
        step = build(history)
        out = generate_tokens(client, list(step.prompts), step.new_tokens, top_k=top_k, timeout=timeout)
        history[name] = [output_ids(r) for r in out]
        served[name] = [ServedStep(cached_tokens(r), served_logprobs(r)) for r in out]
    return served
