"""The bodies of ``hybrid-conformance``'s verbs, one module per job: what a command line
selects (``selection``), the preflight verb (``preflight``), the launch plan (``plan``) and
the pytest front (``run``: ``run`` and ``fuzz``). ``conformance.cli`` wires them to the parser."""
