"""The executor's columnar host path: the vectorised walk of accepted prefixes against the
per-request rule it replaces, and the one-copy upload buffer's layout."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.accept import walk_groups
from executor.host_buffer import HostBuffer


def _reference_walk(host, input_ids, group_rows, num_draft, greedy, has_rejection, forced):
    """The per-request walk (one group at a time), as the rule is written in accept.py."""
    greedy_ids, draw, acc, residual = (list(r) for r in host)
    out_acc, out_tokens = [], []
    for i, d in enumerate(num_draft):
        row = int(group_rows[i])
        drafts = [int(t) for t in input_ids[row + 1 : row + 1 + d]]
        if forced is not None:
            n_acc = min(int(forced[i]), d)
            tokens = greedy_ids[row : row + n_acc + 1]
        elif greedy[i]:
            n_acc = 0
            while n_acc < d and drafts[n_acc] == greedy_ids[row + n_acc]:
                n_acc += 1
            tokens = [*drafts[:n_acc], greedy_ids[row + n_acc]]
        elif has_rejection:
            n_acc = 0
            while n_acc < d and acc[row + n_acc]:
                n_acc += 1
            last = draw[row + d] if n_acc == d else residual[row + n_acc]
            tokens = [*drafts[:n_acc], last]
        else:
            n_acc = 0
            while n_acc < d and drafts[n_acc] == draw[row + n_acc]:
                n_acc += 1
            tokens = [*drafts[:n_acc], draw[row + n_acc]]
        out_acc.append(n_acc)
        out_tokens += tokens
    return out_acc, out_tokens


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(0, 5), st.booleans(), st.integers(0, 6)), min_size=1, max_size=12
    ),
    mode=st.sampled_from(["plain", "rejection", "forced"]),
    seed=st.integers(0, 2**16),
)
def test_vectorised_walk_matches_the_per_request_rule(groups, mode, seed):
    rng = np.random.default_rng(seed)
    num_draft = np.array([g[0] for g in groups], dtype=np.int64)
    greedy = np.array([g[1] for g in groups])
    forced = np.array([g[2] for g in groups], dtype=np.int64) if mode == "forced" else None
    group_rows = np.concatenate([[0], np.cumsum(num_draft + 1)]).astype(np.int64)
    num_rows = int(group_rows[-1])
    # a small alphabet so drafts often match the target's tokens
    input_ids = rng.integers(0, 3, num_rows + 2)
    host = np.stack(
        [
            rng.integers(0, 3, num_rows),
            rng.integers(0, 3, num_rows),
            rng.integers(0, 2, num_rows),
            rng.integers(0, 3, num_rows),
        ]
    ).astype(np.int64)
    has_rejection = mode == "rejection"
    num_acc, num_emitted, tokens = walk_groups(
        host, input_ids, group_rows, num_draft, greedy, has_rejection, forced
    )
    ref_acc, ref_tokens = _reference_walk(
        host, input_ids, group_rows, num_draft, greedy, has_rejection, forced
    )
    assert num_acc.tolist() == ref_acc
    assert num_emitted.tolist() == [a + 1 for a in ref_acc]
    assert tokens.tolist() == ref_tokens


def test_host_buffer_packs_every_region_with_its_dtype_and_shape():
    buf = HostBuffer(torch.device("cpu"))
    # regions of changing sizes, then the same layout again (cached views, new data)
    for round_idx, length in enumerate([5, 6, 7, 7, 7, 3]):
        arrays = {
            "ids": np.arange(length, dtype=np.int64) * 7 + round_idx,
            "cu": np.array([0, 3, length + round_idx], dtype=np.int32),
            "tables": np.arange(6, dtype=np.int32).reshape(2, 3) + round_idx,
            "floats": np.linspace(0, 1, 9, dtype=np.float32).reshape(3, 3) * round_idx,
            "greedy": np.arange(length) % 2 == round_idx % 2,
        }
        buf.start()
        for name, a in arrays.items():
            buf.add(name, a, a.dtype)
        dev = buf.upload()
        for name, a in arrays.items():
            assert dev[name].shape == a.shape
            assert torch.equal(dev[name], torch.from_numpy(a))
            # every region 16-byte aligned: kernels are not recompiled as sizes change
            assert dev[name].data_ptr() % 16 == 0
