"""GPU check of the draft-model drafter's graph replay: the same proposals and the same draft
KV as eager drafting, through catch-ups, partly and fully accepted chains, at several batch
sizes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import DraftModelDrafter
from executor.random_model import random_model

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
MAX_SLOTS = 8
BLOCKS_PER_SLOT = 12


def _drafter(model, graphs: str) -> DraftModelDrafter:
    drafter = DraftModelDrafter(
        model,
        num_blocks=MAX_SLOTS * BLOCKS_PER_SLOT + 1,
        block_size=BLOCK_SIZE,
        max_slots=MAX_SLOTS,
        max_model_len=BLOCKS_PER_SLOT * BLOCK_SIZE,
        graphs=graphs,
    )
    table = np.arange(MAX_SLOTS * BLOCKS_PER_SLOT, dtype=np.int32).reshape(MAX_SLOTS, -1)
    drafter.bind_block_tables(table)
    return drafter


def _eager_and_graphed(seed: int, num_slots: int, context_lens: tuple[int, int]):
    """An eager and a graphed drafter on one fp32 tiny model (both paths run the same kernels,
    so proposals must agree token for token), set up on the same random contexts."""
    model = random_model("tiny", device=torch.device("cuda"), dtype=torch.float32, max_position=512)
    eager, graphed = _drafter(model, "off"), _drafter(model, "lazy")
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    contexts = {
        s: rng.integers(0, vocab, int(rng.integers(*context_lens))).tolist()
        for s in range(num_slots)
    }
    for d in (eager, graphed):
        for slot, ctx in contexts.items():
            d.setup(slot, ctx)
    return eager, graphed, rng, contexts


def test_graphed_drafting_equals_eager_drafting():
    dev = torch.device("cuda")
    eager, graphed, rng, contexts = _eager_and_graphed(0, 6, (5, 40))
    vocab = graphed.model.config.vocab_size
    assert eager.graphs is None and graphed.graphs is not None
    num_draft = 5
    for round_idx in range(6):
        slots = sorted(contexts)[: 2 + round_idx % 5]  # batch sizes 2..6
        reqs = [DraftRequest(s, list(contexts[s]), num_draft) for s in slots]
        out_eager = eager.propose(reqs, [True] * len(reqs)).tokens
        out_graphed = graphed.propose(reqs, [True] * len(reqs)).tokens
        assert out_graphed == out_eager, round_idx
        for i, s in enumerate(slots):
            # accept a varying prefix, all of it on some rounds (then step 0 feeds 2 rows)
            num_accepted = (round_idx + i) % (num_draft + 1)
            contexts[s] += [*out_eager[i][:num_accepted], int(rng.integers(0, vocab))]
            for d in (eager, graphed):
                d.commit(s, contexts[s], num_accepted, num_draft)
    assert np.array_equal(eager.kv_len, graphed.kv_len)
    assert len(graphed.graphs.graphs) > 0
    used = int(eager.kv_len.max())
    for k_e, k_g in zip(eager.kv.k, graphed.kv.k):
        blocks = torch.arange(MAX_SLOTS * BLOCKS_PER_SLOT, device=dev)
        e = k_e[blocks].reshape(MAX_SLOTS, -1, *k_e.shape[2:])[:, :used]
        g = k_g[blocks].reshape(MAX_SLOTS, -1, *k_g.shape[2:])[:, :used]
        for s in range(MAX_SLOTS):
            n = int(eager.kv_len[s])
            torch.testing.assert_close(g[s, :n], e[s, :n], rtol=1e-4, atol=1e-4)


def test_capture_graphs_ahead_and_profile_step_times():
    from executor.profiling.drafts import time_draft_steps

    dev = torch.device("cuda")
    model = random_model("tiny", device=dev, dtype=torch.bfloat16, max_position=512)
    drafter = _drafter(model, "startup")
    # q = 1: buckets 1, 2, 4; q = 2: 2, 4, 8; q = 4: 4, 8, 12, 16
    assert drafter.capture_graphs(4) >= 9
    # a 28-layer draft model: a replayed step is cheaper than launching its kernels one by one
    draft = random_model("qwen3-0.6b", device=dev, dtype=torch.bfloat16, max_position=512)
    graphed = time_draft_steps(draft, (1, 4), repeats=3)
    eager = time_draft_steps(draft, (1, 4), repeats=3, graphs=False)
    assert [r for r, _ in graphed] == [1, 4]
    assert graphed[0][1] < eager[0][1]


@pytest.mark.parametrize("max_passes,wide_pass_rows", [(1, 2048), (8, 2048), (1, 40)])
def test_graphed_catch_up_equals_eager_drafting(max_passes, wide_pass_rows):
    """Requests with different draft counts and lags of up to nine AR rounds (step 0 in graphed
    passes of four rows, or past one pass a wide graph's replay; with 40-row wide passes the
    first round's prompts are cut across passes): graphed drafting proposes what eager
    drafting does and leaves the same draft KV."""
    eager, graphed, rng, contexts = _eager_and_graphed(1, 5, (3, 30))
    vocab = graphed.model.config.vocab_size
    assert eager.catchup_rows_per_pass is None and graphed.catchup_rows_per_pass == 4
    assert eager.wide_graphs is None and graphed.max_catchup_passes == 1
    assert graphed.wide_pass_rows == 2048 and graphed.wide_buckets[-1] == 2048
    graphed.max_catchup_passes = max_passes
    graphed.wide_pass_rows = wide_pass_rows
    assert sum(map(len, contexts.values())) > 40  # the cut passes are several
    for round_idx in range(8):
        for s in contexts:  # AR rounds before this one: 0 .. 9 tokens the drafter missed
            for _ in range(int(rng.integers(0, 10)) if round_idx % 3 == 1 else 0):
                contexts[s].append(int(rng.integers(0, vocab)))
                for d in (eager, graphed):
                    d.commit(s, contexts[s], 0, 0)
        depths = {s: int(rng.integers(1, 8)) for s in contexts}
        reqs = [DraftRequest(s, list(contexts[s]), depths[s]) for s in sorted(contexts)]
        out_eager = eager.propose(reqs, [True] * len(reqs))
        out_graphed = graphed.propose(reqs, [True] * len(reqs))
        assert out_graphed.tokens == out_eager.tokens, round_idx
        for i, s in enumerate(sorted(contexts)):
            num_accepted = int(rng.integers(0, depths[s] + 1))
            contexts[s] += [*out_eager.tokens[i][:num_accepted], int(rng.integers(0, vocab))]
            for d in (eager, graphed):
                d.commit(s, contexts[s], num_accepted, depths[s])
    if max_passes == 1:
        assert len(graphed.wide_graphs.graphs) > 0
    _assert_same_draft_kv(eager, graphed)


def _assert_same_draft_kv(eager, graphed) -> None:
    assert np.array_equal(eager.kv_len, graphed.kv_len)
    blocks = torch.arange(MAX_SLOTS * BLOCKS_PER_SLOT, device=eager.device)
    for k_e, k_g in zip(eager.kv.k, graphed.kv.k):
        e = k_e[blocks].reshape(MAX_SLOTS, -1, *k_e.shape[2:])
        g = k_g[blocks].reshape(MAX_SLOTS, -1, *k_g.shape[2:])
        for s in range(MAX_SLOTS):
            n = int(eager.kv_len[s])
            torch.testing.assert_close(g[s, :n], e[s, :n], rtol=1e-4, atol=1e-4)


def test_graphed_prefill_following_equals_eager():
    """Prefill chunks followed through the wide graphs, then proposals: the same drafts and
    draft KV as an eager drafter following the same chunks."""
    eager, graphed, rng, contexts = _eager_and_graphed(2, 6, (20, 120))
    vocab = graphed.model.config.vocab_size
    done = dict.fromkeys(contexts, 0)
    for chunk in (48, 7, 100):  # rounds of chunks, several requests each
        live = [s for s in contexts if done[s] < len(contexts[s])]
        args = (
            live,
            [done[s] for s in live],
            [contexts[s][done[s] : done[s] + chunk] for s in live],
        )
        assert eager.follow_prefill(*args) == graphed.follow_prefill(*args) > 0
        for s in live:
            done[s] = min(done[s] + chunk, len(contexts[s]))
    assert len(graphed.wide_graphs.graphs) > 0
    for s in contexts:
        contexts[s] = [*contexts[s][: done[s]], int(rng.integers(0, vocab))]
    reqs = [DraftRequest(s, list(contexts[s]), 4) for s in sorted(contexts)]
    out_eager = eager.propose(reqs, [True] * len(reqs))
    out_graphed = graphed.propose(reqs, [True] * len(reqs))
    assert out_graphed.tokens == out_eager.tokens
    assert out_graphed.extra["num_catchup_rows"] == out_eager.extra["num_catchup_rows"]
    _assert_same_draft_kv(eager, graphed)


def test_graphed_catch_ups_beat_one_eager_forward():
    """A 0.6B-shaped draft model catching up nine tokens for 8 requests, and one whole prompt:
    graph replays (passes of four rows, or one wide replay) cost less than one eager forward of
    all rows (launch-bound)."""
    from executor.profiling.drafts import standalone_drafter

    dev = torch.device("cuda")
    draft = random_model("qwen3-0.6b", device=dev, dtype=torch.bfloat16, max_position=2048)
    drafter = standalone_drafter(draft, 8, 1024, 8)
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(0, draft.config.vocab_size, (8, 1000), generator=g).tolist()
    reqs = [DraftRequest(s, contexts[s], 7) for s in range(8)]
    for s in range(8):
        drafter.setup(s, contexts[s])
    wide = drafter.wide_graphs
    times = {}
    for name, behind, num_reqs in (
        ("passes", 9, 8),
        ("wide", 9, 8),
        ("eager", 9, 8),
        ("prompt wide", 999, 1),
        ("prompt eager", 999, 1),
    ):
        drafter.max_catchup_passes = 8 if name == "passes" else 1
        drafter.wide_graphs = None if "eager" in name else wide
        runs = []
        for _ in range(5):
            drafter.kv_len[:num_reqs] = 1000 - behind
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = drafter.propose(reqs[:num_reqs], [True] * num_reqs)
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
            assert out.extra["num_catchup_rows"] == num_reqs * (behind - 1)
        times[name] = sorted(runs[2:])[1]
    print({k: round(v * 1e3, 2) for k, v in times.items()})
    assert times["passes"] < times["eager"], times
    assert times["wide"] < times["eager"], times
    assert times["prompt wide"] < times["prompt eager"], times
