"""Drafters: ngram (prompt lookup), draft-model (small model, chain), synthetic (benchmarks)."""
