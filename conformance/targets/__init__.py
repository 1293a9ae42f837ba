"""Targets: who answers a cell's requests.

* ``registry``  — one :class:`~conformance.targets.registry.Target` per ``--target`` value:
  what the rest of the kit asks of a target (the only place that knows targets by name);
* ``sglang``    — real ``sglang serve`` processes (GPU), commands built and validated in ``sglang.py``;
* ``sglang-cpu``— real SGLang on CPU serving the tiny twins (``sglang_cpu.py``);
* ``reference`` — the kit's own embedded CPU reference server (``conformance/reference/``);
* ``pool``      — the in-process harness over SGLang's real memory pools (``pool/``).
"""
