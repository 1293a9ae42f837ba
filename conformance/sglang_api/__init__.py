"""The SGLang-facing adapter layer: the only package that imports SGLang internals.

``probes`` answers what the installed release offers (a frozen ``Features`` record and its
one-line summary; importing it does not import sglang), ``pool`` picks and loads the pool
driver that fits (``pool_kv`` for the ``req.kv`` lifecycle, ``pool_legacy`` for the older
one), ``validate`` runs SGLang's own CLI parser on any release of the range, and
``release_pins`` holds the install pins per release range for ``ci/setup-cpu.sh``.
"""
