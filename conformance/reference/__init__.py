"""The kit's own embedded reference engine, not SGLang: a CPU server over tiny twins.

``model`` (tiny random-weight twins of the four hybrid families, built with transformers'
own classes) and ``tokenizer``/``twins``/``twin_init`` belong to the twin layer; the
engine, radix cache, pools, faults and HTTP server are built on top of ``model.load_twin``.
"""
