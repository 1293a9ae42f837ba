"""Targets: who answers a cell's requests.

* ``sglang``    — real ``sglang serve`` processes (GPU), commands built and validated in ``sglang.py``;
* ``reference`` — the kit's own embedded CPU reference server (``conformance/reference/``);
* ``pool``      — the in-process harness over SGLang's real memory pools (``pool/``).
"""
