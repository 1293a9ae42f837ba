"""Per-node eviction evidence on real SGLang (the observe plugin's ``state_stored`` /
``state_evicted`` records, ``conformance/sglang_plugins/observe.py``): on a real ``sglang-cpu``
server whose 48-slot mamba pool overflows, the records name exactly the prefixes sent, and
they agree with what SGLang then serves -- a prefix recorded as evicted is not hit at its
stored length, one never recorded as evicted is.  One server (marker ``fault_probe``:
deselected by default, ``-m fault_probe`` runs it)."""

from __future__ import annotations

import json

import pytest
from sglang_cpu_probes import cell_for, probe_server, prompts, tail

from conformance.programs.evidence import RequestLog
from conformance.sglang_plugins.token_digest import token_digest
from conformance.workloads.runners import cached_tokens, generate_tokens

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(900)]


def test_the_states_recorded_as_evicted_are_the_ones_sglang_no_longer_serves(tmp_path) -> None:
    sent = prompts((200,) * 64, seed=61)  # more prompts than the pool's 48 states: LRU evicts the first ones
    with probe_server(cell_for("qwen3-next", "extra_buffer"), tmp_path) as server:
        for p in sent:
            generate_tokens(server.client, [p], 1)
        log = RequestLog(server.report.with_name(server.report.name.removesuffix(".plugins.jsonl") + ".requests.jsonl"))
        log.refresh()
        assert log.started and log.per_node, "the start line does not say the per-node hooks applied"
        stored_len = {}
        for i, p in enumerate(sent):
            lengths = [n for n in range(1, len(p) + 1) if log.state_stored(p[:n])]
            assert lengths, f"prompt {i}: no state_stored record names any prefix of it"
            stored_len[i] = max(lengths)
        evicted = [i for i, p in enumerate(sent) if log.states_evicted.get((stored_len[i], token_digest(p[:stored_len[i]])))]
        kept = [i for i in range(len(sent)) if i not in evicted]
        assert evicted and kept, (evicted, kept)
        assert all(k in log.states_stored for k in log.states_evicted)  # only the tree's states are ever recorded as evicted
        last, first = kept[-1], evicted[0]
        (hit_kept,) = generate_tokens(server.client, [sent[last] + tail(5, "kept")], 1)
        (hit_gone,) = generate_tokens(server.client, [sent[first] + tail(5, "gone")], 1)
        report = {"evicted": len(evicted), "kept": len(kept), "stored_len": stored_len[first],
                  "cached_kept": cached_tokens(hit_kept), "cached_gone": cached_tokens(hit_gone)}
        print(json.dumps(report))
        assert cached_tokens(hit_kept) == stored_len[last], report
        assert cached_tokens(hit_gone) < stored_len[first], report
