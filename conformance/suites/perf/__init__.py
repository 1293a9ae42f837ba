"""Suite: what each cell's Mamba caching strategy costs -- TTFT cold and on a prefix hit,
prefill and decode tok/s at 1 and N requests, pool peaks, resident track slots -- measured
with the run's other tests held back (``quiet``); ratios across cells in the report.

When it runs (``conformance.suites.perf.selection``): on the real targets (``sglang-cpu``, ``sglang``) in
the standard and nightly tiers; on the kit's reference engine, or in the premerge tier,
only when asked for (``--suite perf``, ``-m perf``, or its path), and then labelled.
"""
