"""Pure checks: recorded responses in, a :class:`conformance.records.Verdict` out; no I/O.

``kl``, ``prefix_branching``, ``leaks`` and ``gsm8k`` hold one verdict function each
(``kl_verdict``, ``prefix_branching_verdict``, ``leak_verdict``, ``gsm8k_verdict``) plus
the frozen record types the runners in ``conformance.workloads.runners`` fill in.
``stats`` holds the scipy-based statistics, ``prefix_oracle`` the cache-hit predictor.
"""
