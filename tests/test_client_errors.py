"""How ``SGLangClient`` words a failing answer: the dead server's cause first (its exit and
last exception, from ``liveness``), then the answer's body, so the one-line reports that keep
300 characters (``conformance.report.outcomes.one_line``) name why a PD unit or a server failed."""

from __future__ import annotations

import httpx
import pytest

from conformance.client import SGLangClient
from conformance.errors import KitError, ServerDiedError
from conformance.report.outcomes import one_line

ROUTER_BODY = '{"error":{"type":"Bad Gateway","code":"prefill_server_error","message":"Prefill server error: ' + "x" * 400 + '"}}'
CAUSE = ("PD prefill: server process exited with code -9; RuntimeError: Boolean value of Tensor with more than one value "
         "is ambiguous (tokenizer_manager.py:2093)")


def client_answering(status: int, body: str, liveness=None) -> SGLangClient:
    client = SGLangClient("http://pd-router.test", liveness=liveness)
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(lambda request: httpx.Response(status, text=body)))
    return client


class _Report:
    def __init__(self, message: str) -> None:
        self.longrepr = type("Repr", (), {"reprcrash": type("Crash", (), {"message": message})()})()


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_servers_cause_leads_the_one_line_report(stream):
    client = client_answering(502, ROUTER_BODY, liveness=lambda: CAUSE)
    with pytest.raises(ServerDiedError) as err:
        list(client.generate_stream({"text": "hi"})) if stream else client.generate({"text": "hi"})
    line = one_line(_Report(f"conformance.errors.ServerDiedError: {err.value}"))
    assert "RuntimeError: Boolean value of Tensor" in line and "HTTP 502" in line, line
    assert "answer: {\"error\"" in str(err.value)  # the body is still there, after the cause


def test_a_live_servers_refusal_keeps_its_body_and_class():
    with pytest.raises(KitError) as err:
        client_answering(400, '{"error": "bad input"}', liveness=lambda: None).generate({"text": "hi"})
    assert not isinstance(err.value, ServerDiedError)
    assert str(err.value) == 'POST http://pd-router.test/generate: HTTP 400; answer: {"error": "bad input"}'
