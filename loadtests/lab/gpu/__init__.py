"""`hipfire-bench gpu`: the end-to-end engine benchmark on real-shaped random-weight models."""
