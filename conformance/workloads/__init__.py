"""Workloads: what is sent to a server, seeded and deterministic.

``prompts`` (token/text prompts of controlled lengths), ``trees`` (branching trees),
``sessions`` (session scripts for the leak check), ``gsm8k`` (data and few-shot prompts)
and ``runners`` (send a workload through ``SGLangClient`` and return frozen records).
"""
