"""Pool tier: SGLang's real Mamba memory management driven on CPU with no model.

``sglang_api`` owns every SGLang symbol; ``runtime`` publishes a resolved ServerArgs per
cell; ``harness`` drives requests; ``state_marker`` stands in for model states;
``invariants`` holds the checks; ``machine`` is the hypothesis state machine.
"""
