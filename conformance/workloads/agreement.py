"""The agreement workload: one scripted conversation with the radix cache, sent in the same
order to two servers (real SGLang on CPU and the reference engine).

Steps cover every way the cache is reached: a cold prompt, the same prompt again, a
continuation of prompt + output, a branch inside the first chunk boundary, a batch of
two siblings, a decode that crosses a track boundary and a follow-up that extends it;
then, from a flushed cache, the multi-turn chains of ``trees.multi_turn_tree`` (the
prefix_branching suite's ``test_multi_turn_reuse``): each turn the previous turn's prompt
+ output + new tokens, so each turn's hit is what the tree kept of the turn before.
Lengths are relative to the cell's chunk and track grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from conformance.recordings import ServedStep
from conformance.client import SGLangClient
from conformance.workloads.prompts import extension, token_prompts
from conformance.workloads.runners import cached_tokens, generate_tokens, output_ids, served_logprobs
from conformance.workloads.trees import BranchTree, continued, multi_turn_tree

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class ScriptStep:
    """One step of the agreement script: its requests (one, or a batch) and the tokens each
    generates; ``flush_before``: the cache is flushed first."""

    name: str
    prompts: tuple[Tokens, ...]  # one request, or a batch
    new_tokens: int
    flush_before: bool = False

    def labels(self) -> list[str]:
        """Each request's label: the step's name, ``name[i]`` in a batch."""
        return [self.name] if len(self.prompts) == 1 else [f"{self.name}[{i}]" for i in range(len(self.prompts))]


@dataclass(frozen=True)
class Answered:
    """One request of the script as one server answered it: its label, the rid it was sent
    with (None: the server chose one), its prompt and the answer."""

    label: str
    rid: str | None
    prompt: Tokens
    served: ServedStep


def agreement_script(*, chunk: int, grid: int, vocab_size: int, new_tokens: int = 12) -> list:
    """Steps as callables of what was sent: ``[(name, build(sent) -> ScriptStep)]``, ``sent``
    mapping each earlier request's label to its (prompt, output)."""
    (p,) = token_prompts([2 * chunk + 37], vocab_size=vocab_size, seed=31)
    (q,) = token_prompts([grid - 5], vocab_size=vocab_size, seed=32)
    ext = lambda tag, n=5: extension(n, vocab_size=vocab_size, seed=f"agree:{tag}")  # noqa: E731
    return [
        ("cold", lambda h: ScriptStep("cold", (p,), new_tokens)),
        ("repeat", lambda h: ScriptStep("repeat", (p,), new_tokens)),
        ("continue", lambda h: ScriptStep("continue", (continued(h, "cold", ext("c")),), new_tokens)),
        ("branch", lambda h: ScriptStep("branch", (p[: chunk + 10] + ext("b", 9),), new_tokens)),
        ("siblings", lambda h: ScriptStep("siblings", (p + ext("s1"), p + ext("s2")), new_tokens)),
        ("decode_cross", lambda h: ScriptStep("decode_cross", (q,), new_tokens)),
        ("decode_follow", lambda h: ScriptStep("decode_follow", (continued(h, "decode_cross", ext("d", 3)),), new_tokens)),
        *multi_turn_steps(multi_turn_tree(chunk=chunk, track_interval=grid, vocab_size=vocab_size)),
    ]


def multi_turn_steps(tree: BranchTree) -> list:
    """``tree``'s requests (``multi_turn_tree``: one per turn) as script steps named by their path."""
    return [(r.path, lambda h, r=r: ScriptStep(r.path, (r.prompt(h),), r.max_new_tokens, r.flush_before)) for r in tree.requests]


def run_agreement(client: SGLangClient, script: Sequence, *, top_k: int = 5, timeout: float | None = None,
                  rid_tag: str | None = None) -> list[Answered]:
    """Flush once, then send the steps in order (flushing before a step that asks): every
    request's answer in order.  ``rid_tag``: send each request with the rid ``<tag>-<label>``
    (so the server's per-request records name it)."""
    client.flush_cache()
    sent: dict[str, tuple[Tokens, Tokens]] = {}
    out: list[Answered] = []
    for _name, build in script:
        step = build(sent)
        if step.flush_before:
            client.flush_cache()
        labels = step.labels()
        rids = [f"{rid_tag}-{label}" for label in labels] if rid_tag else [None] * len(labels)
        answers = generate_tokens(client, list(step.prompts), step.new_tokens, top_k=top_k, timeout=timeout,
                                  rids=rids if rid_tag else None)
        for label, rid, prompt, r in zip(labels, rids, step.prompts, answers):
            sent[label] = (prompt, output_ids(r))
            out.append(Answered(label, rid, prompt, ServedStep(cached_tokens(r), served_logprobs(r), len(prompt))))
    return out
