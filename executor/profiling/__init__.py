"""Timings of device work for the cost profile: whole executor rounds (`rounds`), draft-model and
host drafters' proposals and catch-ups (`drafts`), and the device's copy and GEMM ceilings
(`device`). What drives whole engine steps and assembles the profile belongs to the product
layer above the executor."""
