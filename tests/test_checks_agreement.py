"""The agreement check on hand-built answers: agreement passes, each kind of disagreement
fails with its number, and nothing compared (or no cache hit) is refused; SGLang's hit on
each request is judged against what its tree held (issue 43: the multi-turn chains), and the
workload plays those chains turn on turn."""

from __future__ import annotations

from conformance.checks.agreement import agreement_verdict
from conformance.checks.findings import findings_of
from conformance.checks.held import Expected
from conformance.recordings import AgreementStep, ServedStep, TokenLogprobs
from conformance.workloads.agreement import agreement_script, run_agreement
from conformance.workloads.trees import multi_turn_tree

from test_workloads_fake_server import FakeSGLang


def served(tokens, lps, cached=0, shift=0.0, input_len=0):
    top = tuple(((t, lp + shift), (t + 1, lp - 2.0 + shift)) for t, lp in zip(tokens, lps))
    return ServedStep(cached, TokenLogprobs(tuple(tokens), tuple(lp + shift for lp in lps), top), input_len)


def pair(name, cached_a=0, cached_b=0, tokens_b=None, shift=0.0):
    toks, lps = [5, 6, 7, 8], [-0.1, -0.5, -1.0, -0.2]
    return AgreementStep(name, served(toks, lps, cached_a), served(tokens_b or toks, lps, cached_b, shift))


def test_agreement_passes_with_numbers():
    v = agreement_verdict([pair("cold"), pair("repeat", 128, 128, shift=3e-6)])
    assert v.status == "pass", v.reason
    assert v.metrics["tokens"] == 8 and v.metrics["steps_with_hits"] == 1
    assert 2e-6 < v.metrics["max_logprob_gap"] < 4e-6


def test_cached_tokens_disagreement_fails():
    v = agreement_verdict([pair("cold"), pair("repeat", 128, 64)])
    assert v.status == "fail" and "cached_tokens sglang 128 vs reference 64" in v.reason
    assert v.metrics["cached_mismatches"] == 1


def test_token_and_logprob_disagreement_fail():
    v = agreement_verdict([pair("repeat", 128, 128, tokens_b=[5, 6, 9, 8])])
    assert v.status == "fail" and "differ from position 2" in v.reason and v.metrics["token_mismatches"] == 2
    v = agreement_verdict([pair("repeat", 128, 128, shift=1e-3)])
    assert v.status == "fail" and "logprobs differ by 0.001" in v.reason


def test_refuses_vacuous_runs():
    assert agreement_verdict([]).status == "fail"
    v = agreement_verdict([pair("cold"), pair("again")])
    assert v.status == "fail" and "no step hit the cache" in v.reason


# ------------------------------------------------------------------ what SGLang's tree held (issue 43)
def turns(*hits: int) -> list[AgreementStep]:
    """A chain's turns, both servers reporting ``hits`` alike (so only the held rule can tell)."""
    toks, lps = [5, 6, 7, 8], [-0.1, -0.5, -1.0, -0.2]
    return [AgreementStep(f"chunks/{t}", served(toks, lps, h, input_len=100 + 70 * t), served(toks, lps, h)) for t, h in enumerate(hits)]


#: SGLang's per-node records: after turn 0 its tree held a state of 64 tokens for turn 1's
#: prompt, after turn 1 one of 128 for turn 2's.
HELD = {"chunks/0": Expected(True, 0), "chunks/1": Expected(True, 64), "chunks/2": Expected(True, 128)}


def test_a_turn_below_what_the_tree_held_fails_though_both_servers_agree():
    """A stored state not reused across turns (the seeded fault stored_state_not_reused's
    effect): turn 2 answered 64 while SGLang's tree held 128.  The reference engine reported
    64 too (agreement alone passed it); the held rule names the turn."""
    assert agreement_verdict(turns(0, 64, 64)).status == "pass"  # before: agreement alone
    v = agreement_verdict(turns(0, 64, 64), owed=HELD)
    assert v.status == "fail" and v.reason.startswith("chunks/2: cached_tokens 64: SGLang held a state of 128 tokens")
    (f,) = findings_of(v)
    assert f.kind == "hit_below_held" and f.facts["step"] == "chunks/2" and f.facts["input"] == 240


def test_turns_that_reuse_what_the_tree_held_pass_and_say_it_was_exact():
    v = agreement_verdict(turns(0, 64, 128), owed=HELD)
    assert v.status == "pass", v.reason
    assert v.metrics["held_exact"] == 3 and v.details["expected_hit"] == "exact (3 requests)"
    assert [r.get("held") for r in v.details["steps"]] == [0, 64, 128]
    bounded = agreement_verdict(turns(0, 64, 64), owed={**HELD, "chunks/2": Expected(False, why="no per-node records on this target")})
    assert bounded.status == "pass" and bounded.details["expected_hit"] == "exact for 2 requests, bounded for 1 (1 no per-node records on this target)"


class Recorder:
    """A client that records each /generate payload and flush, and answers through ``FakeSGLang``."""

    def __init__(self, fake: FakeSGLang) -> None:
        self.fake, self.calls = fake, []

    def generate(self, payload, *, timeout=None):
        self.calls.append(("generate", payload))
        return self.fake.generate({k: v for k, v in payload.items() if k != "rid"}, timeout=timeout)

    def flush_cache(self):
        self.calls.append(("flush", None))
        self.fake.flush_cache()


def test_the_script_plays_the_multi_turn_chains_turn_on_turn():
    """After the scripted steps, from a flushed cache, the chains of multi_turn_tree (the
    prefix_branching suite's workload): each turn is the previous turn's prompt + output + its
    own tokens, sent with a rid the per-node records name, and each later turn hits."""
    client = Recorder(FakeSGLang())
    answered = run_agreement(client, agreement_script(chunk=16, grid=32, vocab_size=48), rid_tag="t")
    tree = multi_turn_tree(chunk=16, track_interval=32, vocab_size=48)
    by = {a.label: a for a in answered}
    assert [a.label for a in answered][-len(tree.requests):] == [r.path for r in tree.requests]
    for r in tree.requests:
        a = by[r.path]
        want = r.tokens if r.extends is None else by[r.extends].prompt + tuple(by[r.extends].served.logprobs.token_ids) + r.tokens
        assert a.prompt == want and a.served.input_len == len(want) and a.rid == f"t-{r.path}"
        assert (a.served.cached_tokens > 0) == (r.extends is not None), (r.path, a.served.cached_tokens)
    generates = [p for kind, p in client.calls if kind == "generate"]
    assert generates[-1]["rid"] == [f"t-{tree.requests[-1].path}"]
    first_turn = [i for i, (kind, p) in enumerate(client.calls) if kind == "generate" and p["input_ids"] == [list(tree.requests[0].tokens)]]
    assert client.calls[first_turn[0] - 1][0] == "flush"  # the chains start from a flushed cache
