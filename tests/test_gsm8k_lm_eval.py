"""GSM8K through lm-eval: the local data check, the task file that includes lm-eval's own
gsm8k.yaml, lm-eval's per-sample log turned into a recording, and lm-eval run end to end
against a small HTTP server that answers from the gold answers (right, wrong, or failing) with
every non-loopback connection refused (proof that nothing reaches for the hub)."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conformance.checks.gsm8k import gsm8k_verdict
from conformance.errors import KitError
from conformance.workloads import gsm8k as g
from conformance.workloads.gsm8k_lm_eval import LmEvalGSM8K, engine_name, recording_from_samples

GSM8K_DIR = Path(os.environ.get(g.ENV_DIR, Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"))


@pytest.fixture(scope="module")
def data() -> g.GSM8KData:
    if not (GSM8K_DIR / g.TEST_FILE).is_file():
        pytest.fail(f"GSM8K data not found at {GSM8K_DIR}; set {g.ENV_DIR}")
    return g.load_local(GSM8K_DIR)


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from conformance.reference.twins import ensure_twin

    return str(ensure_twin("tiny-qwen3-next"))


def test_local_data_is_verified_and_the_task_is_lm_evals_gsm8k_on_it(data, tmp_path):
    assert (data.n_test, data.n_train) == (1319, 8) and data.local
    name = g.write_task(tmp_path, data, shots=2)
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(tmp_path), include_defaults=False).load([name])["tasks"][name]
    task.set_fewshot_seed(1234)
    assert task.config.doc_to_text == "Question: {{question}}\nAnswer:"  # lm-eval's, not the kit's
    assert [f.name for f in task._filters] == ["strict-match", "flexible-extract"]
    docs = list(task.test_docs())
    assert len(docs) == 1319 and docs[0]["question"].startswith("Janet")
    ctx = task.fewshot_context(docs[0], num_fewshot=2)
    train = [json.loads(line)["question"] for line in (GSM8K_DIR / g.TRAIN_FILE).read_text().splitlines()]
    assert ctx.count("Question:") == 3 and ctx.endswith("Answer:")
    assert train[0] in ctx and train[1] in ctx and train[2] not in ctx  # first_n: one shared prefix
    assert g.pick_items(data, 3, offset=5) == [5, 6, 7]
    with pytest.raises(KitError, match="only|has 1319"):
        g.pick_items(data, 2, offset=1318)
    with pytest.raises(KitError, match="9 shots"):
        g.write_task(tmp_path, data, shots=9)


def test_bad_dir_and_tampered_file_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(KitError, match="not found"):
        g.load_local(tmp_path)
    (tmp_path / g.TEST_FILE).write_text('{"question": "q", "answer": "a\\n#### 1"}\n')
    (tmp_path / g.TRAIN_FILE).write_text('{"question": "q", "answer": "a\\n#### 1"}\n')
    with pytest.raises(KitError, match="sha256"):
        g.load_local(tmp_path)
    (tmp_path / g.TEST_FILE).write_text('{"question": "q"}\n')
    with pytest.raises(KitError, match=r"test.jsonl:1: not a GSM8K row"):
        g.load_local(tmp_path, verify=False)
    monkeypatch.delenv(g.ENV_DIR, raising=False)
    with pytest.raises(KitError, match="no data directory"):
        g.load_gsm8k(None, allow_hub=False)
    monkeypatch.setenv(g.ENV_DIR, str(tmp_path))
    with pytest.raises(KitError, match="sha256"):
        g.load_gsm8k(None)


def _sample(doc: int, filt: str, em: float, text: str = "x") -> dict:
    return {"doc_id": doc, "filter": filt, "exact_match": em, "resps": [[text]], "filtered_resps": ["1"]}


def test_per_sample_log_becomes_one_answer_per_item():
    log = [_sample(1, "strict-match", 0.0), _sample(1, "flexible-extract", 1.0), _sample(0, "flexible-extract", 0.0, "y"),
           _sample(0, "strict-match", 1.0, "y")]
    rec = recording_from_samples(log, shots=2, label="l", engine="lm-eval 9")
    assert [(a.index, a.completion, a.strict, a.flexible) for a in rec.answers] == [(0, "y", True, False), (1, "x", False, True)]
    assert rec.engine == "lm-eval 9"
    with pytest.raises(KitError, match="no result for filter"):
        recording_from_samples(log[:1], shots=2, label="l", engine="e")
    with pytest.raises(KitError, match="two different completions"):
        recording_from_samples([*log, _sample(1, "strict-match", 0.0, "other")], shots=2, label="l", engine="e")


# ------------------------------------------------------------------ lm-eval end to end
class _GoldServer:
    """/v1/completions and /generate answering each question with its gold answer, a wrong
    number, or HTTP 500 (``mode``); it records every prompt it was sent."""

    def __init__(self, gold: dict[str, str]) -> None:
        self.gold, self.mode, self.prompts, self.stops = gold, "right", [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.mode == "fail":
                    self._send(500, {"error": {"message": "boom"}})
                    return
                prompts = body.get("prompt", body.get("text"))
                prompts = prompts if isinstance(prompts, list) else [prompts]
                outer.prompts += prompts
                outer.stops.append(body.get("stop") or body.get("sampling_params", {}).get("stop"))
                texts = [outer.answer(p) for p in prompts]
                if self.path == "/generate":
                    out = [{"text": t, "meta_info": {}} for t in texts]
                    self._send(200, out if isinstance(body["text"], list) else out[0])
                else:
                    self._send(200, {"choices": [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)]})

            def _send(self, code: int, payload: object) -> None:
                raw = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, prompt: str) -> str:
        question = prompt.rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
        gold = self.gold[question]
        return " " + (gold if self.mode == "right" else "so #### 999999") + "\n\nQuestion: next one"


@pytest.fixture
def gold_server(data):
    rows = [json.loads(line) for line in (GSM8K_DIR / g.TEST_FILE).read_text().splitlines()[:8]]
    srv = _GoldServer({r["question"]: r["answer"] for r in rows})
    yield srv
    srv.httpd.shutdown()


@pytest.fixture
def no_network(monkeypatch):
    """Every connect() to a non-loopback address raises (and is counted)."""
    attempts: list[object] = []
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else str(address)
        if isinstance(address, tuple) and host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"test: network disabled ({address})")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return attempts


@pytest.mark.parametrize("api", ["local-completions", "sglang-generate"])
def test_lm_eval_scores_right_and_wrong_answers_offline(data, tokenizer_dir, gold_server, no_network, tmp_path, api):
    info = {"tokenizer_path": tokenizer_dir, "served_model_name": "gold"}
    driver = LmEvalGSM8K.for_server(data, gold_server.url, info, task_dir=tmp_path / "tasks", shots=2, max_gen_toks=8, api=api)
    log = tmp_path / "samples.jsonl"
    right = driver.record([0, 1, 2, 3], label="right", samples_log=log)
    assert [a.index for a in right.answers] == [0, 1, 2, 3] and right.engine == engine_name()
    assert all(a.strict and a.flexible for a in right.answers)
    assert all("Question:" in stop for stop in gold_server.stops)  # lm-eval's stop sequences, sent to the server
    assert len(gold_server.prompts) == 4 and all(p.count("Question:") == 3 for p in gold_server.prompts)
    gold_server.mode = "wrong"
    wrong = driver.record([0, 1, 2, 3], label="wrong", samples_log=log)
    assert not any(a.strict or a.flexible for a in wrong.answers)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 16 and {ln["label"] for ln in lines} == {"right", "wrong"}  # 4 items x 2 filters x 2 runs
    assert {ln["filter"] for ln in lines} == {"strict-match", "flexible-extract"}
    v = gsm8k_verdict(wrong, mode="accuracy", baseline=right, min_accuracy=0.9)
    assert v.status == "fail" and v.metrics["engine"].startswith("lm-eval ") and v.metrics["accuracy"] == 0.0
    assert gsm8k_verdict(wrong, mode="agreement", baseline=right).status == "fail"
    assert gsm8k_verdict(right, mode="agreement", baseline=right).status == "pass"
    assert no_network == []


def test_a_failing_server_is_one_line_kit_error(data, tokenizer_dir, gold_server, tmp_path):
    gold_server.mode = "fail"
    driver = LmEvalGSM8K.for_server(data, gold_server.url, {"tokenizer_path": tokenizer_dir}, task_dir=tmp_path, shots=1, max_gen_toks=4)
    with pytest.raises(KitError, match=r"lm-eval gsm8k against http://127\.0\.0\.1:\d+: HTTPError") as err:
        driver.record([0])
    assert "\n" not in str(err.value)
    with pytest.raises(KitError, match="names no tokenizer_path"):
        LmEvalGSM8K.for_server(data, gold_server.url, {}, task_dir=tmp_path, shots=1, max_gen_toks=4)
