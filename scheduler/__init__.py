"""Torch-free scheduling: slot pool, admission, the per-round speculative/AR policy, simulator."""
