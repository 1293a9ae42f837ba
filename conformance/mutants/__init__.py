"""Seeded faults and the mutation score: ``pool_faults`` (monkeypatches of SGLang's real
functions, loaded with ``pytest -p conformance.mutants.pool_faults``), ``catalogue`` (where
each fault is exercised) and ``command`` (``hybrid-conformance mutants``)."""
