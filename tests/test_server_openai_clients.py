"""Third-party clients against the reference server: the ``openai`` client's completions and
chat completions with ``stream=True`` and ``n=2``, and SGLang's SSE stream on ``/generate``
(cumulative text, ``[DONE]``), each checked against the same request without streaming."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conformance.reference.twins import ensure_twin
from conformance.targets.reference_launch import start_reference


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sp, url = start_reference(tmp_path_factory.mktemp("srv"), "--model", "tiny-qwen3-next", "--strategy", "extra_buffer")
    try:
        yield url
    finally:
        sp.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def test_completions_stream_equals_the_whole_answer_and_n_gives_n_choices(client):
    whole = client.completions.create(model="m", prompt="The capital of France is", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="m", prompt="The capital of France is", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and len(text) > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    two = client.completions.create(model="m", prompt=["a b c", "d e f"], max_tokens=4, temperature=0.9, n=2, seed=3)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.usage.completion_tokens == 16


def test_chat_uses_the_twins_template_and_streams(client, server):
    messages = [{"role": "user", "content": "Say hi in one word."}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    template = httpx.post(server + "/generate", json={"text": "<|im_start|>user\nSay hi in one word.<|im_end|>\n<|im_start|>assistant\n",
                                                      "sampling_params": {"max_new_tokens": 10, "temperature": 0}}, timeout=60).json()
    assert whole.choices[0].message.content == template["text"]  # the ChatML template of tokenizer_config.json
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert len(client.chat.completions.create(model="m", messages=messages, max_tokens=3, n=3, temperature=1.0).choices) == 3


def test_generate_streams_sglang_events(server):
    body = {"text": "Tell me a story", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    whole = httpx.post(server + "/generate", json=body, timeout=60).json()
    with httpx.stream("POST", server + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    assert len(events) >= 2 and events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert all(a["text"] == b["text"][: len(a["text"])] for a, b in zip(events, events[1:]))  # cumulative
    assert events[0]["meta_info"]["finish_reason"] is None and events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    bad = httpx.post(server + "/generate", json={**body, "text": ["a", "b"], "stream": True}, timeout=60)
    assert bad.status_code == 400 and "single request" in bad.json()["error"]["message"]


def test_tokenizer_folder_is_what_server_info_names(server):
    info = httpx.get(server + "/server_info", timeout=10).json()
    assert info["tokenizer_path"] == str(ensure_twin("tiny-qwen3-next")) and info["context_length"] == 131072
