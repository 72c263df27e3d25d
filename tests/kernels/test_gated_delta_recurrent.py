"""The fused gated-delta-rule kernels against their torch references and against plain
recurrence (interpreter on CPU, fp32, small shapes).

A round mixes AR rows (state written back) and SPEC groups of several depths (compact journal,
slot untouched); committing a group at any accepted length j replays rows 0..j from the slot
and must equal running those rows one AR round at a time.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_recurrent import (
    gated_delta_rows,
    gated_delta_rows_ref,
    replay_journal,
    replay_journal_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-5


def _round(seed: int, lens: list[int], spec: list[bool], hk=2, hv=4, dk=16, dv=8, slots=None):
    """Raw inputs of one layer's round: sequences of `lens` rows laid out back to back."""
    g = torch.Generator().manual_seed(seed)
    num_rows = sum(lens)
    num_slots = len(lens) + 2
    x = {
        "q": torch.randn(num_rows, hk, dk, generator=g),
        "k": torch.randn(num_rows, hk, dk, generator=g),
        "v": torch.randn(num_rows, hv, dv, generator=g),
        "g": -torch.rand(num_rows, hv, generator=g) * 1.5,
        "beta": torch.rand(num_rows, hv, generator=g),
        "state": torch.randn(num_slots, hv, dk, dv, generator=g) * 0.3,
    }
    x = {n: t.to(DEV) for n, t in x.items()}
    slots = slots or [num_slots - 1 - i for i in range(len(lens))]  # scattered, reversed
    starts = [sum(lens[:i]) for i in range(len(lens))]
    jstarts, j = [], 0
    for n, s in zip(lens, spec):
        jstarts.append(j if s else -1)
        j += n if s else 0
    seqs = torch.tensor([slots, starts, lens, jstarts], dtype=torch.int64, device=DEV)
    journal = (
        torch.zeros(j, hk, dk, device=DEV),
        torch.zeros(j, hv, device=DEV),
        torch.zeros(j, hv, dv, device=DEV),
    )
    return x, seqs, journal


def _run(fn, x, seqs, journal):
    state = x["state"].clone()
    out = torch.zeros(x["v"].shape, device=DEV)
    journal = tuple(t.clone() for t in journal)
    fn(x["q"], x["k"], x["v"], x["g"], x["beta"], state, out, seqs, journal)
    return state, out, journal


@pytest.mark.parametrize(
    ("lens", "spec"),
    [
        ([1], [False]),
        ([1, 1, 1], [False] * 3),
        ([4], [True]),
        ([3, 1, 6, 2, 1], [True, False, True, True, False]),
    ],
)
@pytest.mark.parametrize("dv", [8, 40])  # one Dv tile, and several with a ragged last one
def test_rows_kernel_matches_reference(lens, spec, dv):
    x, seqs, journal = _round(len(lens) * 7 + dv, lens, spec, dv=dv)
    state, out, jr = _run(gated_delta_rows, x, seqs, journal)
    want_state, want_out, want_jr = _run(gated_delta_rows_ref, x, seqs, journal)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=ATOL, rtol=1e-5)
    for a, b in zip(jr, want_jr):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)
    # SPEC groups' slots are untouched, AR slots moved
    for slot, n, js in zip(*(seqs[i].tolist() for i in (0, 2, 3))):
        same = torch.equal(state[slot], x["state"][slot])
        assert same == (js >= 0), (slot, n, js)


def test_reference_is_the_layer_recurrence():
    """The reference against `executor.delta_rule.recurrent_step` fed as the layer feeds it
    (q, k l2-normed, q scaled, key heads repeated over their value heads), row by row."""
    from executor.delta_rule import recurrent_step

    x, seqs, journal = _round(2, [3], [True], hk=2, hv=6, dk=8, dv=4)
    _, out, _ = _run(gated_delta_rows_ref, x, seqs, journal)
    slot = int(seqs[0, 0])
    s = x["state"][slot][None].clone()
    norm = torch.nn.functional.normalize
    for t in range(3):
        q = (norm(x["q"][t], dim=-1, eps=0) * 8**-0.5).repeat_interleave(3, dim=0)[None]
        k = norm(x["k"][t], dim=-1, eps=0).repeat_interleave(3, dim=0)[None]
        o = recurrent_step(s, q, k, x["v"][t][None], x["g"][t][None], x["beta"][t][None])
        torch.testing.assert_close(out[t], o[0], atol=1e-4, rtol=1e-4)


def test_grouped_heads_share_their_key_head():
    """Hv = 3 Hk: value heads 0..2 read key head 0, 3..5 key head 1 (a swapped axis shows)."""
    x, seqs, journal = _round(3, [5, 2], [True, False], hk=2, hv=6, dk=8, dv=16)
    state, out, jr = _run(gated_delta_rows, x, seqs, journal)
    want_state, want_out, want_jr = _run(gated_delta_rows_ref, x, seqs, journal)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(jr[0], want_jr[0], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("fns", ["kernel", "reference"])
def test_commit_at_every_accepted_length_equals_ar(fns):
    """Three SPEC groups of depths 1, 4 and 7 rows beside an AR row; for every accepted length
    j of each group, replaying j + 1 journal rows gives the state that running rows 0..j as
    AR rounds (one row per round) leaves, in both layers of a two-layer state."""
    rows_fn, replay_fn = {
        "kernel": (gated_delta_rows, replay_journal),
        "reference": (gated_delta_rows_ref, replay_journal_ref),
    }[fns]
    lens, spec = [1, 4, 1, 7], [True, True, False, True]
    layers = []
    for layer in range(2):
        x, seqs, journal = _round(11 + layer, lens, spec)
        layers.append((x, seqs, *_run(rows_fn, x, seqs, journal)))
    groups = [i for i, s in enumerate(spec) if s]
    for depth in range(max(lens)):
        for i in groups:
            if depth >= lens[i]:
                continue
            slot, start, jstart = (int(layers[0][1][r, i]) for r in (0, 1, 3))
            # the round's slot state (before it), every layer, and the replay of depth + 1 rows
            state = torch.stack([x["state"] for x, *_ in layers])  # [L, S, Hv, Dk, Dv]
            jk, jg, ju = (torch.stack([lay[4][n] for lay in layers]) for n in range(3))
            grp = torch.tensor([[slot], [jstart], [depth + 1]], dtype=torch.int64, device=DEV)
            replay_fn(state, grp, jk, jg, ju)
            for li, (x, *_) in enumerate(layers):
                ar = x["state"].clone()
                for t in range(depth + 1):  # one AR round per row
                    row = start + t
                    one = torch.tensor([[slot], [row], [1], [-1]], dtype=torch.int64, device=DEV)
                    out = torch.zeros(x["v"].shape, device=DEV)
                    rows_fn(x["q"], x["k"], x["v"], x["g"], x["beta"], ar, out, one)
                torch.testing.assert_close(state[li, slot], ar[slot], atol=ATOL, rtol=1e-5)
                others = [s for s in range(ar.shape[0]) if s != slot]
                assert torch.equal(state[li, others], x["state"][others])


def test_replay_kernel_matches_reference():
    g = torch.Generator().manual_seed(5)
    layers, slots_n, hk, hv, dk, dv, rows = 3, 5, 2, 4, 16, 40, 12
    state = torch.randn(layers, slots_n, hv, dk, dv, generator=g).to(DEV)
    jk = torch.nn.functional.normalize(torch.randn(layers, rows, hk, dk, generator=g), dim=-1)
    jg = -torch.rand(layers, rows, hv, generator=g)
    ju = torch.randn(layers, rows, hv, dv, generator=g)
    jk, jg, ju = jk.to(DEV), jg.to(DEV), ju.to(DEV)
    groups = torch.tensor([[4, 0, 2], [0, 3, 9], [3, 6, 1]], dtype=torch.int64, device=DEV)
    a, b = state.clone(), state.clone()
    replay_journal(a, groups, jk, jg, ju)
    replay_journal_ref(b, groups, jk, jg, ju)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)
    assert torch.equal(a[:, [1, 3]], state[:, [1, 3]])  # slots no group names


def test_wrapper_refuses_bad_layouts():
    x, seqs, journal = _round(0, [2], [True])
    out = torch.zeros(x["v"].shape, device=DEV)
    with pytest.raises(AssertionError):  # a state in the model dtype
        gated_delta_rows(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"].half(), out, seqs)
    with pytest.raises(AssertionError):  # the layout's rows as int32
        gated_delta_rows(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], out, seqs.int(), journal
        )


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_real_shape_on_gpu(num_seqs):
    """Qwen3.5-27B's linear-layer shape (16 key heads, 48 value heads, 128 x 128), every
    sequence a SPEC group of 8 rows: kernel against the reference."""
    lens = [8] * num_seqs
    x, seqs, journal = _round(1, lens, [True] * num_seqs, hk=16, hv=48, dk=128, dv=128)
    state, out, jr = _run(gated_delta_rows, x, seqs, journal)
    _, want_out, want_jr = _run(gated_delta_rows_ref, x, seqs, journal)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    for a, b in zip(jr, want_jr):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(state, x["state"])


def test_hybrid_forward_through_the_kernels_equals_the_reference_path():
    """The tiny random Qwen3.5 through the kernels (interpreter) and through the references:
    a prefill chunk, a round of an AR row beside a SPEC group committed at 2 of its 5 drafts,
    then AR rows; the same logits and the same states."""
    from executor.random_model import random_model
    from tests.executor.test_hybrid_model import Runner

    model = random_model("tiny-qwen3.5", device=torch.device(DEV), dtype=torch.float32)
    ids = torch.randint(1, 512, (32,), generator=torch.Generator().manual_seed(3)).tolist()
    logits, runners = [], []
    for fns in ((gated_delta_rows, replay_journal), (gated_delta_rows_ref, replay_journal_ref)):
        r = Runner(model, 2)
        r.states.delta_rows, r.states.replay = fns
        got = [*r.run({0: ids[:12], 1: ids[:5]})]
        got += r.run({0: ids[12:18], 1: ids[5:6]}, drafts={0: 5})
        r.commit([0], [2])
        got += [*r.run({0: ids[15:16], 1: ids[6:7]})]
        logits.append(torch.cat(got))
        runners.append(r)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(runners[0].states.ssm, runners[1].states.ssm, atol=1e-5, rtol=0)
    torch.testing.assert_close(runners[0].states.conv, runners[1].states.conv, atol=1e-5, rtol=0)
