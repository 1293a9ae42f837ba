"""A CPU stand-in module for SGLang written for another release: it hooks a symbol 0.5.23
does not have (tests/test_sglang_cpu_start_failures.py)."""

from conformance.sglang_plugins.cpu.spec import Binding

TORCH_OPS = ()
BINDINGS = (Binding("sglang.srt.layers.no_such_module.no_such_kernel", lambda *a, **k: None, "replace", "test: a target this release lacks"),)
