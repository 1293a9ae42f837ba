"""Pool tier: SGLang's real Mamba memory management driven on CPU with no model.

The drivers, their contract (``pool_driver``), the ServerArgs per cell (``pool_runtime``)
and the state marker that stands in for model states (``state_marker``) live in
``conformance.sglang_api``, the only package that imports sglang internals; this package
imports them and never the other way.  ``harness.PoolHarness`` builds the driver the
installed release fits; ``invariants`` holds the checks; ``machine`` is the hypothesis
state machine; ``scenarios`` the scripted ones.
"""
