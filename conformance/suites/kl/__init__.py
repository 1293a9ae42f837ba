"""Suite: KL divergence between cached (prefill-hit, decode-hit) and cold logprobs, per cell."""
