"""hybrid-conformance's stand-in for the ``sgl_kernel`` package, on the path of the
``sglang-cpu`` servers the kit launches only (never installed into an environment).

SGLang imports ``sgl_kernel`` at start-up, before its plugins run; PyPI's package ships
CUDA libraries only.  This module registers the kit's torch ops under
``torch.ops.sgl_kernel`` and binds the Python symbols SGLang's CPU paths import; any
other symbol is a placeholder that raises, naming itself, if SGLang ever calls it.
"""

from conformance.sglang_plugins.cpu.standin import install as _install

_install(__name__)
