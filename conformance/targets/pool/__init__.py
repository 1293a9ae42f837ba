"""Pool tier: SGLang's real Mamba memory management driven on CPU with no model.

``driver`` is the contract every SGLang-facing pool driver offers (the drivers themselves
live in ``conformance.sglang_api``, the only package that imports sglang internals);
``harness.PoolHarness`` picks the one the installed release fits; ``runtime`` builds the
ServerArgs per cell; ``state_marker`` stands in for model states; ``invariants`` holds the
checks; ``machine`` is the hypothesis state machine; ``scenarios`` the scripted ones.
"""
