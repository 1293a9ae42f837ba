"""GSM8K data and the lm-eval task that reads it.

Data comes from a local directory (``--gsm8k-dir`` or ``HYBRID_CONFORMANCE_GSM8K_DIR``)
holding ``test.jsonl`` and ``train_first8.jsonl``, both verified by sha256; without one,
lm-eval's own ``gsm8k`` task reads ``openai/gsm8k`` through ``datasets`` (the user's machine,
never CI).  The prompt layout, stop sequences, answer filters and metric are lm-eval's
(``lm_eval/tasks/gsm8k/gsm8k.yaml``): the kit only writes a small task file that includes it
and points ``dataset_path: json`` at the local files.  Few-shot exemplars come from the train
split (``first_n``, so every question shares one few-shot prefix: cache hits), never from
scored test items.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from conformance.errors import KitError

ENV_DIR = "HYBRID_CONFORMANCE_GSM8K_DIR"
TEST_FILE, TRAIN_FILE = "test.jsonl", "train_first8.jsonl"
SHA256 = {
    TEST_FILE: "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    TRAIN_FILE: "3f7ee50a459a52ed756683a31829ee9feb74db2b71c5638a09bf31139b8fee14",
}
BASE_TASK = "gsm8k"  # lm-eval's task, included by the kit's task file
FILTERS = {"strict": "strict-match", "flexible": "flexible-extract"}  # lm-eval's filter names


@dataclass(frozen=True)
class GSM8KData:
    """Where GSM8K is read from: a verified local folder, or the hub (``folder`` None)."""

    folder: Path | None
    n_test: int
    n_train: int
    source: str

    @property
    def local(self) -> bool:
        return self.folder is not None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _count_rows(path: Path) -> int:
    n = 0
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not (isinstance(row["question"], str) and "####" in row["answer"]):
                raise ValueError("no '####' line in the answer")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise KitError(f"{path}:{i + 1}: not a GSM8K row ({type(e).__name__}: {e})") from None
        n += 1
    return n


def load_local(directory: str | os.PathLike[str], *, verify: bool = True) -> GSM8KData:
    """Check ``test.jsonl`` and ``train_first8.jsonl`` in ``directory`` (sha256 and rows)."""
    d = Path(directory).expanduser().resolve()
    for name, digest in SHA256.items():
        p = d / name
        if not p.is_file():
            raise KitError(f"GSM8K: {p} not found (set --gsm8k-dir or {ENV_DIR} to a folder with {TEST_FILE} and {TRAIN_FILE})")
        if verify and (got := _sha256(p)) != digest:
            raise KitError(f"GSM8K: {p} has sha256 {got[:16]}..., expected {digest[:16]}... (wrong or modified file)")
    return GSM8KData(d, _count_rows(d / TEST_FILE), _count_rows(d / TRAIN_FILE), str(d))


def load_gsm8k(directory: str | os.PathLike[str] | None = None, *, allow_hub: bool = True) -> GSM8KData:
    """The option's directory, else the env var's, else lm-eval's hub dataset (when allowed)."""
    d = directory or os.environ.get(ENV_DIR)
    if d:
        return load_local(d)
    if not allow_hub:
        raise KitError(f"GSM8K: no data directory (use --gsm8k-dir or {ENV_DIR})")
    return GSM8KData(None, 1319, 7473, "datasets:openai/gsm8k")


def lm_eval_base_yaml() -> Path:
    """lm-eval's own gsm8k.yaml (the prompt, stops, filters and metric the kit uses)."""
    try:
        import lm_eval.tasks
    except ImportError:
        raise KitError("GSM8K needs lm-eval: pip install 'lm-eval[api]==0.4.13' (ci/setup-cpu.sh installs it)") from None
    path = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
    if not path.is_file():
        raise KitError(f"lm-eval has no {path} (an lm-eval release without the gsm8k task?)")
    return path


def task_config(data: GSM8KData, *, name: str, shots: int) -> dict:
    """lm-eval task config: lm-eval's gsm8k task on ``data`` with ``shots`` first-n exemplars."""
    if shots > data.n_train:
        raise KitError(f"GSM8K: {shots} shots requested but the train split has {data.n_train} exemplars")
    config: dict = {"include": str(lm_eval_base_yaml()), "task": name, "tag": [], "num_fewshot": shots,
                    "fewshot_config": {"sampler": "first_n"}}
    if data.local:
        config.update({"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": {
            "test": str(data.folder / TEST_FILE), "train": str(data.folder / TRAIN_FILE)}}})
    return config


def write_task(folder: Path, data: GSM8KData, *, shots: int) -> str:
    """Write the task file into ``folder`` (an lm-eval ``include_path``); the task's name."""
    name = f"hc_gsm8k_{shots}shot_{'local' if data.local else 'hub'}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(task_config(data, name=name, shots=shots), indent=1) + "\n")  # JSON is YAML
    tmp.replace(path)
    return name


def pick_items(data: GSM8KData, n: int, *, offset: int = 0) -> list[int]:
    """Indices (lm-eval ``doc_id``) of ``n`` test items from ``offset``."""
    if n <= 0 or offset < 0 or offset + n > data.n_test:
        raise KitError(f"GSM8K: asked for {n} items from {offset}, the test split has {data.n_test}")
    return list(range(offset, offset + n))
