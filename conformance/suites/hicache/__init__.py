"""HiCache suite: prefixes reloaded from SGLang's host tier (``--enable-hierarchical-cache``)."""
