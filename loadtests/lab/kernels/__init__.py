"""Kernel benchmarks: verify attention and the small kernels, the skinny linear layer, PDL."""
