"""Triton kernels, each with a host wrapper, a pure-torch reference and an arch config entry.

A wrapper and its reference take the same arguments: the executor swaps one for the other
(`executor.ops`), and tests/kernels/test_references.py holds them to it."""
