"""Triton kernels, each with a host wrapper, a pure-torch reference and an arch config entry."""
