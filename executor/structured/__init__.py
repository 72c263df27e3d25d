"""Structured outputs and logit bias on the verify path: grammars compiled by llguidance, one
matcher per slot, the per-round token bitmask and bias entries of every row a constrained
request samples or verifies (`slot_constraints.py`), applied on the device by
`executor.sampling.apply_token_bitmask` / `apply_logit_bias` before acceptance."""
