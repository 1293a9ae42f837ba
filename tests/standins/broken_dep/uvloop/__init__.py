"""A broken ``uvloop`` put first on a server's path: SGLang's start-up import fails the way a
missing dependency does (tests/test_sglang_cpu_start_failures.py)."""

raise ImportError("uvloop is broken on purpose by hybrid-conformance's tests")
