"""Agreement suite: real SGLang on CPU against the kit's reference engine (``--target sglang-cpu``)."""
