"""The device ops of output constraints against plain references: a grammar's token bitmask keeps
exactly the tokens its bits allow on exactly the rows it names, a logit bias adds at its entries,
and the bias never lifts a token the grammar forbids."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import sampling
from executor.structured.slot_constraints import DeviceConstraints


def reference_mask(logits: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for g, row in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[g, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@settings(max_examples=60, deadline=None)
@given(
    num_rows=st.integers(1, 6),
    vocab=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_bitmask_keeps_exactly_the_allowed_tokens_of_the_named_rows(num_rows, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((num_rows, vocab)).astype(np.float32))
    rows = np.sort(rng.choice(num_rows, int(rng.integers(1, num_rows + 1)), replace=False))
    width = -(-vocab // 32)
    bitmask = rng.integers(-(2**31), 2**31, (len(rows), width), dtype=np.int64).astype(np.int32)
    out = sampling.apply_token_bitmask(
        logits, torch.from_numpy(bitmask), torch.from_numpy(rows.astype(np.int64))
    )
    assert torch.equal(out, reference_mask(logits, bitmask, rows))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_entries=st.integers(0, 12))
def test_logit_bias_adds_at_its_entries(seed, num_entries):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((5, 9)).astype(np.float32))
    cells = rng.choice(5 * 9, num_entries, replace=False)
    rows, ids = cells // 9, cells % 9
    values = rng.uniform(-100, 100, num_entries).astype(np.float32)
    out = sampling.apply_logit_bias(
        logits, torch.from_numpy(rows), torch.from_numpy(ids), torch.from_numpy(values)
    )
    expected = logits.clone()
    for r, t, v in zip(rows, ids, values):
        expected[r, t] += float(v)
    assert torch.equal(out, expected)


def test_a_bias_never_lifts_a_token_the_grammar_forbids():
    logits = torch.zeros(2, 40)
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 1 << 3  # row 1: only token 3
    dc = DeviceConstraints(
        mask_rows=torch.tensor([1]),
        bitmask=torch.from_numpy(bitmask),
        bias_rows=torch.tensor([0, 1, 1]),
        bias_ids=torch.tensor([5, 5, 3]),
        bias_values=torch.tensor([100.0, 100.0, -100.0]),
    )
    out = dc.apply(logits)
    assert out[0, 5] == 100.0 and out[0].argmax() == 5  # row 0: bias only
    assert out[1, 5] == float("-inf")  # forbidden whatever its bias
    assert out[1, 3] == -100.0 and torch.isinf(out[1]).sum() == 39  # allowed, biased down
