"""GSM8K items and few-shot prompts.

Data comes from a local directory (``--gsm8k-dir`` or ``HYBRID_CONFORMANCE_GSM8K_DIR``)
holding ``test.jsonl`` and ``train_first8.jsonl``, both verified by sha256; without one,
``datasets.load_dataset("openai/gsm8k", "main")`` fetches it on the user's machine.
Few-shot exemplars come from the train split only, never from scored test items.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from conformance.checks.gsm8k import gold_answer
from conformance.errors import KitError

ENV_DIR = "HYBRID_CONFORMANCE_GSM8K_DIR"
TEST_FILE, TRAIN_FILE = "test.jsonl", "train_first8.jsonl"
SHA256 = {
    TEST_FILE: "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    TRAIN_FILE: "3f7ee50a459a52ed756683a31829ee9feb74db2b71c5638a09bf31139b8fee14",
}
STOP = ("Question:", "\n\n\n")


@dataclass(frozen=True)
class GSM8KItem:
    index: int
    question: str
    answer: str  # the full answer field, ending in "#### N"

    @property
    def gold(self) -> str:
        return gold_answer(self.answer)


@dataclass(frozen=True)
class GSM8KData:
    test: tuple[GSM8KItem, ...]
    train: tuple[GSM8KItem, ...]
    source: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_jsonl(path: Path) -> tuple[GSM8KItem, ...]:
    items = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append(GSM8KItem(i, row["question"], row["answer"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise KitError(f"{path}:{i + 1}: not a GSM8K row ({type(e).__name__}: {e})") from None
    return tuple(items)


def load_local(directory: str | os.PathLike[str], *, verify: bool = True) -> GSM8KData:
    """Read and sha256-verify ``test.jsonl`` and ``train_first8.jsonl`` in ``directory``."""
    d = Path(directory)
    for name, digest in SHA256.items():
        p = d / name
        if not p.is_file():
            raise KitError(f"GSM8K: {p} not found (set --gsm8k-dir or {ENV_DIR} to a folder with {TEST_FILE} and {TRAIN_FILE})")
        if verify and _sha256(p) != digest:
            raise KitError(f"GSM8K: {p} has sha256 {_sha256(p)[:16]}..., expected {digest[:16]}... (wrong or modified file)")
    return GSM8KData(_read_jsonl(d / TEST_FILE), _read_jsonl(d / TRAIN_FILE), str(d))


def load_hub(*, shots: int = 8) -> GSM8KData:  # pragma: no cover - needs network, user's machine only
    """openai/gsm8k through ``datasets`` (the user's machine; never used in CI)."""
    try:
        from datasets import load_dataset

        ds = load_dataset("openai/gsm8k", "main")
    except Exception as e:  # datasets raises many types; one line for the user
        raise KitError(f"GSM8K: no local dir given and datasets could not load openai/gsm8k: {type(e).__name__}: {e}") from None
    test = tuple(GSM8KItem(i, r["question"], r["answer"]) for i, r in enumerate(ds["test"]))
    train = tuple(GSM8KItem(i, r["question"], r["answer"]) for i, r in enumerate(ds["train"].select(range(shots))))
    return GSM8KData(test, train, "datasets:openai/gsm8k")


def load_gsm8k(directory: str | os.PathLike[str] | None = None, *, allow_hub: bool = True) -> GSM8KData:
    """The option's directory, else the env var's, else ``datasets`` (when allowed)."""
    d = directory or os.environ.get(ENV_DIR)
    if d:
        return load_local(d)
    if not allow_hub:
        raise KitError(f"GSM8K: no data directory (use --gsm8k-dir or {ENV_DIR})")
    return load_hub()


def few_shot_prompt(question: str, exemplars: Sequence[GSM8KItem], shots: int) -> str:
    """``shots`` train exemplars then the question, in the lm-eval GSM8K layout."""
    if shots > len(exemplars):
        raise KitError(f"GSM8K: {shots} shots requested but only {len(exemplars)} exemplars")
    parts = [f"Question: {e.question}\nAnswer: {e.answer}\n\n" for e in exemplars[:shots]]
    return "".join(parts) + f"Question: {question}\nAnswer:"


def select_items(data: GSM8KData, n: int, *, offset: int = 0) -> tuple[GSM8KItem, ...]:
    """``n`` test items from ``offset``; refuses items whose question is an exemplar."""
    items = data.test[offset : offset + n]
    if len(items) < n:
        raise KitError(f"GSM8K: asked for {n} items from {offset}, only {len(items)} available")
    shots = {e.question for e in data.train}
    if any(it.question in shots for it in items):
        raise KitError("GSM8K: a scored test item is also a few-shot exemplar")
    return items


def trim_completion(text: str) -> str:
    """Cut a completion at the first stop sequence (servers that ignore ``stop``)."""
    cut = min((i for i in (text.find(s) for s in STOP) if i >= 0), default=len(text))
    return text[:cut]
