"""What SGLang's HTTP API exposes, named once: the wire names the kit reads and writes
(today the ``/metrics`` names, :mod:`conformance.sglang_contract.metric_names`).  It imports
nothing of the kit, so every layer can use it."""
