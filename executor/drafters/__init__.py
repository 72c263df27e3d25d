"""Drafters: ngram (prompt lookup), draft-model (small model, chain), synthetic (benchmarks); the
block drafter's checkpoint loader and reference forward (block_config, block_model)."""
