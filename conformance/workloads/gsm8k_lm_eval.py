"""Run lm-eval's GSM8K task against one server and turn its per-sample log into a recording.

lm-eval does the work: ``local-completions`` (OpenAI ``/v1/completions``) or its
``sglang-generate`` adapter (SGLang's native ``/generate``, for the PD router), the task file
written by ``workloads.gsm8k``, its few-shot sampler, stop sequences, ``strict-match`` and
``flexible-extract`` filters and ``exact_match`` metric.  The kit keeps lm-eval's per-sample
log (one JSON line per item and filter) and hands the per-item results to the check.

Offline by construction: the data are local JSON files, the tokenizer is the server's own
folder, and ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` are set before
lm-eval (hence ``datasets``) is imported, so nothing reaches for the hub.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from conformance.recordings import GSM8KAnswer, GSM8KRecording
from conformance.errors import KitError
from conformance.workloads.gsm8k import FILTERS, GSM8KData, write_task

Api = Literal["local-completions", "sglang-generate"]
ROUTES: dict[str, str] = {"local-completions": "/v1/completions", "sglang-generate": "/generate"}
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_EVALUATE_OFFLINE": "1"}
FEWSHOT_SEED = 1234  # lm-eval's default; first_n sampling does not use it, set for completeness


def engine_name() -> str:
    """``lm-eval <version>``: what every gsm8k verdict names as its engine."""
    try:
        return f"lm-eval {importlib.metadata.version('lm_eval')}"
    except importlib.metadata.PackageNotFoundError:
        raise KitError("GSM8K needs lm-eval: pip install 'lm-eval[api]==0.4.13' (ci/setup-cpu.sh installs it)") from None


def go_offline(local_tokenizer: bool = True) -> None:
    """Set the hub switches off (datasets always; hub and transformers for a local tokenizer)."""
    for key, value in OFFLINE_ENV.items():
        if key == "HF_DATASETS_OFFLINE" or local_tokenizer:
            os.environ[key] = value


@dataclass(frozen=True)
class LmEvalGSM8K:
    """lm-eval's GSM8K against ``base_url``; ``record(doc_ids)`` runs the items given."""

    data: GSM8KData
    base_url: str
    tokenizer: str
    task_dir: Path
    shots: int
    max_gen_toks: int
    api: Api = "local-completions"
    concurrency: int = 1
    timeout_s: int = 300
    model: str = "default"

    @classmethod
    def for_server(cls, data: GSM8KData, base_url: str, info: dict[str, Any], *, task_dir: Path, shots: int,
                   max_gen_toks: int, api: Api = "local-completions", concurrency: int = 1) -> "LmEvalGSM8K":
        """The driver for a running server: its tokenizer is the one ``/server_info`` names."""
        tokenizer = info.get("tokenizer_path") or info.get("model_path")
        if not tokenizer:
            raise KitError(f"GSM8K: {base_url}/server_info names no tokenizer_path or model_path for lm-eval")
        return cls(data, base_url, str(tokenizer), task_dir, shots, max_gen_toks, api=api, concurrency=concurrency,
                   model=str(info.get("served_model_name") or info.get("model_path") or "default"))

    def record(self, doc_ids: Sequence[int], *, label: str = "", samples_log: Path | None = None) -> GSM8KRecording:
        """Run the items ``doc_ids``; write lm-eval's per-sample log to ``samples_log``."""
        samples = self.run(doc_ids)
        if samples_log is not None:
            samples_log.parent.mkdir(parents=True, exist_ok=True)
            with samples_log.open("a", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps({"label": label, **s}, default=str) + "\n")
        return recording_from_samples(samples, shots=self.shots, label=label, engine=engine_name())

    def run(self, doc_ids: Sequence[int]) -> list[dict[str, Any]]:
        """lm-eval's per-sample records (``log_samples``) for ``doc_ids``, in lm-eval's form."""
        go_offline(local_tokenizer=Path(self.tokenizer).is_dir())
        name = write_task(self.task_dir, self.data, shots=self.shots)
        try:
            import lm_eval
            from lm_eval.api.registry import get_model
            from lm_eval.tasks import TaskManager
        except ImportError:
            engine_name()  # the one-line install hint
            raise
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        lm = get_model(self.api)(
            base_url=self.base_url.rstrip("/") + ROUTES[self.api], model=self.model, tokenizer=self.tokenizer,
            tokenizer_backend="huggingface", tokenized_requests=False, max_gen_toks=self.max_gen_toks,
            num_concurrent=self.concurrency, max_retries=1, timeout=self.timeout_s,
        )
        loaded = TaskManager(include_path=str(self.task_dir), include_defaults=False).load([name])
        for task in loaded["tasks"].values():
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        try:
            results = lm_eval.evaluate(lm=lm, task_dict=loaded, samples={name: list(doc_ids)}, log_samples=True,
                                       bootstrap_iters=0)
        except Exception as exc:  # lm-eval raises requests/tenacity/aiohttp errors: one line for the report
            raise KitError(f"lm-eval gsm8k against {self.base_url}: {type(exc).__name__}: {str(exc)[:300]}") from None
        return list(results["samples"][name])


def recording_from_samples(samples: Iterable[dict[str, Any]], *, shots: int, label: str, engine: str) -> GSM8KRecording:
    """One answer per ``doc_id``: lm-eval's raw completion and its ``exact_match`` per filter."""
    rows: dict[int, dict[str, Any]] = {}
    for s in samples:
        row = rows.setdefault(int(s["doc_id"]), {"completion": _completion(s)})
        if row["completion"] != _completion(s):
            raise KitError(f"lm-eval log: doc {s['doc_id']} has two different completions")
        for key, lm_name in FILTERS.items():
            if s.get("filter") == lm_name:
                row[key] = bool(s["exact_match"])
    answers = []
    for doc_id in sorted(rows):
        row = rows[doc_id]
        missing = [FILTERS[k] for k in FILTERS if k not in row]
        if missing:
            raise KitError(f"lm-eval log: doc {doc_id} has no result for filter(s) {', '.join(missing)}")
        answers.append(GSM8KAnswer(doc_id, row["completion"], strict=row["strict"], flexible=row["flexible"]))
    return GSM8KRecording(tuple(answers), shots, label, engine)


def _completion(sample: dict[str, Any]) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return str(first[0] if isinstance(first, list) else first)
