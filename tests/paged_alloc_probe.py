"""Run inside a release's venv by tests/test_paged_alloc_releases.py: the feature probe's
answer for SGLang's paged KV allocator, and SGLang's own ``alloc_extend_kernel`` launched
on CPU tensors (two requests: one continuing a half-used page, one from scratch).  Prints
one JSON line: the probe's answer and the kernel's indices, or the error it raised."""

from __future__ import annotations

import json
import sys

import torch

from conformance.sglang_api.probes import _paged_alloc_triton_only


def main() -> None:
    out: dict = {"triton_only": _paged_alloc_triton_only()}
    try:
        paged = __import__("sglang.srt.mem_cache.allocator.paged", fromlist=["alloc_extend_kernel"])
        page = 4
        prefix, seq = torch.tensor([6, 0]), torch.tensor([10, 3])
        last_loc = torch.tensor([4 * 7 + 1, -1])  # request 0's prefix ends in page 7, slot 1
        free_pages = torch.tensor([2, 3, 9], dtype=torch.int64)
        indices = torch.empty(int((seq - prefix).sum()), dtype=torch.int64)
        paged.alloc_extend_kernel[(2,)](prefix, seq, last_loc, free_pages, indices, 2, page)
        out["indices"] = indices.tolist()
    except Exception as e:  # e.g. RuntimeError: 0 active drivers
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
