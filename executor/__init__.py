"""Device side: HF loading, paged KV cache, ragged forward, drafters, round executor."""
