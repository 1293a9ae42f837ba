"""Code that runs INSIDE the real SGLang servers the kit launches, through SGLang's own
extension points (never by editing SGLang's files).

* ``platform``: an out-of-tree platform (entry-point group ``sglang.srt.platforms``), the
  CPU platform SGLang selects when the kit sets ``SGLANG_PLATFORM``;
* ``general``: general plugins (entry-point group ``sglang.srt.plugins``): CPU enablement
  (torch stand-ins for Triton-only and AMX-gated spots) and seeded faults;
* ``standin/sgl_kernel``: the ``sgl_kernel`` stand-in module put on the path of the
  ``sglang-cpu`` servers only (SGLang imports ``sgl_kernel`` before any plugin runs);
* ``activation``: the env vars that switch all of this on, and the report every plugin
  writes so the kit can prove it ran before trusting a result.

Every entry point does nothing unless the kit's env var is set, so an SGLang server the
user starts in the same environment is untouched.
"""
