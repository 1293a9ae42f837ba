"""Record the transcripts in ``tests/data/checks/`` from real SGLang on CPU.

Every call the kit's runners make (``record_kl``, ``record_tree``) and SGLang's answer are
kept, so ``tests/test_workloads_runners.py`` replays them through the same runner code and
judges them with the checks; ``cached_tokens``, logprobs and tokens come from SGLang's own
scheduler, radix cache and pools (the ``sglang-cpu`` target serving the tiny Qwen3-Next
twin), not from the prefix oracle that judges them.  ``MANIFEST.json`` says which SGLang
version, cell, dtype and server settings recorded them.

    python tests/data/record_checks.py                       # launches two sglang-cpu servers
    python tests/data/record_checks.py --fp32-url URL --bf16-url URL   # or uses running ones

Each server must serve the ``qwen3-next-80b-extra_buffer-p1-t256`` cell (float32 and
bfloat16).  Takes 5-10 minutes on two cores, most of it server start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import sys
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE / "checks"
CELL_ID = "qwen3-next-80b-extra_buffer-p1-t256"

# The workloads: shared with the tests that replay them (a replay must make the same calls).
VOCAB = 512  # ids of the random prompts; the twin's vocabulary is larger
CHUNK, TRACK = 64, 256  # SGLang's mamba cache chunk (FLA) and track interval for the cell
KL = dict(n=4, max_len=400, new_tokens=8, top_k=5, turn1_tokens=8)
TREE = dict(fanout=2, depth=2, max_new_tokens=3)
SERVER_KEYS = ("version", "dtype", "page_size", "mamba_track_interval", "mamba_radix_cache_strategy",
               "disable_overlap_schedule", "chunked_prefill_size", "max_mamba_cache_size", "max_total_num_tokens")

#: name -> (dtype of the server it is recorded on, what it records)
RECORDINGS = {
    "kl_prefill_hit_fp32.json.gz": ("float32", "kl:prefill_hit"),
    "kl_prefill_hit_bf16.json.gz": ("bfloat16", "kl:prefill_hit"),
    "kl_decode_hit_bf16.json.gz": ("bfloat16", "kl:decode_hit"),
    "tree_fp32.json.gz": ("float32", "tree"),
}


def kl_prompts(scenario: str) -> list[tuple[int, ...]]:
    from conformance.workloads.prompts import decode_cross_lengths, prefill_hit_lengths, token_prompts

    if scenario == "prefill_hit":
        lengths = prefill_hit_lengths(CHUNK, TRACK, n=KL["n"], max_len=KL["max_len"])
    else:
        lengths = decode_cross_lengths(TRACK, KL["turn1_tokens"], n=2, max_len=KL["max_len"])
    return token_prompts(lengths, vocab_size=VOCAB, seed=11 if scenario == "prefill_hit" else 12)


def record_kl(client: Any, scenario: str):
    from conformance.workloads.runners import record_kl as run

    return run(client, kl_prompts(scenario), vocab_size=VOCAB, scenario=scenario, new_tokens=KL["new_tokens"],
               top_k=KL["top_k"], turn1_tokens=KL["turn1_tokens"])


def tree():
    from conformance.workloads.trees import branching_tree

    return branching_tree(chunk=CHUNK, track_interval=TRACK, vocab_size=VOCAB, seed=3, **TREE)


def record_tree(client: Any):
    from conformance.workloads.runners import record_tree as run

    return run(client, tree())


def run_workload(client: Any, what: str):
    if what.startswith("kl:"):
        return record_kl(client, what.split(":", 1)[1])
    return record_tree(client)


def load(name: str) -> list[dict]:
    with gzip.open(OUT / name, "rt", encoding="utf-8") as f:
        return json.load(f)


def manifest() -> dict:
    return json.loads((OUT / "MANIFEST.json").read_text())


# ------------------------------------------------------------------ recording
@contextlib.contextmanager
def _server(dtype: str, url: str | None) -> Iterator[Any]:
    from conformance.client import SGLangClient

    if url:
        with SGLangClient(url) as client:
            yield client
        return
    from conformance.matrix.cells import load_matrix
    from conformance.targets.serving import serve_cell

    cell = next(c for c in load_matrix().select(target="sglang-cpu", tier="nightly") if c.id == CELL_ID)
    opts = argparse.Namespace(target="sglang-cpu", dtype=dtype, sglang_launcher=None, twins=False, gpus_per_worker=1)
    with serve_cell(cell, opts, log_dir=Path("reports") / "record_checks") as ep:
        yield ep.client


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from test_workloads_fake_server import Recorder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32-url", help="a running sglang-cpu server for the cell in float32")
    ap.add_argument("--bf16-url", help="a running sglang-cpu server for the cell in bfloat16")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    servers: dict[str, dict] = {}
    for dtype, url in (("float32", args.fp32_url), ("bfloat16", args.bf16_url)):
        with _server(dtype, url) as client:
            info = client.server_info()
            if info.get("dtype") != dtype or info.get("mamba_radix_cache_strategy") != "extra_buffer":
                raise SystemExit(f"record_checks: the {dtype} server serves dtype {info.get('dtype')}, strategy {info.get('mamba_radix_cache_strategy')}")
            servers[dtype] = {k: info.get(k) for k in SERVER_KEYS}
            for name, (want, what) in RECORDINGS.items():
                if want != dtype:
                    continue
                rec = Recorder(client)
                run_workload(rec, what)
                with gzip.open(OUT / name, "wt", encoding="utf-8") as f:
                    json.dump(rec.calls, f, separators=(",", ":"))
                print(f"wrote {OUT / name}: {len(rec.calls)} calls")
    versions = {s["version"] for s in servers.values()}
    (OUT / "MANIFEST.json").write_text(json.dumps({
        "recorded_by": "python tests/data/record_checks.py",
        "sglang_version": versions.pop() if len(versions) == 1 else sorted(versions),
        "target": "sglang-cpu",
        "cell": CELL_ID,
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "servers": servers,
        "recordings": {name: {"dtype": d, "workload": w} for name, (d, w) in RECORDINGS.items()},
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
