"""The bodies of ``hybrid-conformance``'s verbs, one module per job: what a command line
selects (``selection``), the preflight verb (``preflight``), the launch plan (``plan``),
the pytest front (``run``) and the request-program runs (``fuzz``). ``conformance.cli``
wires them to the parser."""
