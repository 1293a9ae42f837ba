"""Suite: generated branching trees; observed cached_tokens against the prefix oracle, outputs on hits against cold."""
