"""The target forward's hidden-state capture against transformers' `output_hidden_states` (fp32,
CPU, ragged paged batches), its cost when off, and its rows as a block drafter's context."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from executor.drafters.block_model import load_block_drafter
from executor.hidden_capture import HiddenCapture
from executor.loader import load_model
from tests.executor.test_model_vs_hf import ATOL, PagedRunner, _hf
from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter
from tests.fixtures.tiny_models import make_tiny_model

transformers = pytest.importorskip("transformers")

LAYER_IDS = (2, 0)  # out of order, and the last layer (which HF reports after the final norm)
MAX_ROWS = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, one_torch_thread):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "qwen3", seed=3, num_hidden_layers=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype="float32")


class CapturingForward:
    """The model as PagedRunner drives it, with every forward capturing into `capture`."""

    def __init__(self, model, capture: HiddenCapture | None):
        self.model, self.capture = model, capture
        self.config = model.config

    def forward(self, input_ids, meta, k_caches, v_caches):
        return self.model.forward(input_ids, meta, k_caches, v_caches, capture=self.capture)

    def logits(self, hidden):
        return self.model.logits(hidden)


def _capture(model, layer_ids=LAYER_IDS) -> HiddenCapture:
    capture = HiddenCapture.allocate(
        layer_ids, MAX_ROWS, model.config.hidden_size, dtype=model.dtype, device=model.device
    )
    capture.out.fill_(float("nan"))  # rows a forward must leave alone stay NaN
    return capture


def _hf_rows(hf, ids: list[int], lo: int, hi: int, layer_ids) -> torch.Tensor:
    """HF's hidden states of positions lo..hi-1, layers side by side: [hi - lo, n * hidden]."""
    with torch.no_grad():
        states = hf(torch.tensor([ids[:hi]]), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0, lo:hi] for i in layer_ids], dim=-1)


def test_capture_matches_transformers_on_ragged_paged_batches(target, target_dir):
    hf = _hf(target_dir)
    g = torch.Generator().manual_seed(11)
    seqs = [
        torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (27, 14)
    ]
    capture = _capture(target)
    runner = PagedRunner(CapturingForward(target, capture), num_seqs=2)
    # forward 1: two prefill chunks of different lengths; forward 2: a 5-row group beside one
    # AR row, on the paged KV the first one wrote
    for cuts in (((0, 22), (0, 13)), ((22, 27), (13, 14))):
        runner.run({s: seqs[s][lo:hi] for s, (lo, hi) in enumerate(cuts)})
        want = torch.cat(
            [_hf_rows(hf, seqs[s], lo, hi, LAYER_IDS) for s, (lo, hi) in enumerate(cuts)]
        )
        num_rows = want.shape[0]
        torch.testing.assert_close(capture.rows(num_rows), want, atol=ATOL, rtol=0)
        if cuts[0][0] == 0:
            assert capture.out[num_rows:].isnan().all()  # only the forward's rows are written


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_capture_leaves_logits_bit_identical_and_adds_only_its_copies(target):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, target.config.vocab_size, (19,), generator=g).tolist()
    outs, counts = [], []
    for capture in (None, _capture(target)):
        runner = PagedRunner(CapturingForward(target, capture), num_seqs=1)
        with _OpCounter() as counter:
            outs.append(runner.run({0: ids})[0])
        counts.append(counter.ops)
    assert torch.equal(outs[0], outs[1])
    extra = counts[1] - counts[0]
    assert counts[0] - counts[1] == Counter()
    assert extra["aten.copy_"] == len(LAYER_IDS)
    assert set(extra) <= {"aten.copy_", "aten.slice"}  # a copy into a view per captured layer


def test_captured_rows_feed_a_block_drafters_context(target, tmp_path):
    drafter_dir = make_tiny_block_drafter(
        tmp_path,
        target.config,
        seed=5,
        dflash_config={"mask_token_id": target.config.vocab_size - 1, "target_layer_ids": [0, 2]},
    )
    drafter = load_block_drafter(drafter_dir, target)
    capture = _capture(target, drafter.config.target_layer_ids)
    ids = list(range(3, 23))
    PagedRunner(CapturingForward(target, capture), num_seqs=1).run({0: ids})
    features = drafter.project_context(capture.rows(len(ids)))  # [20, hidden]
    assert features.shape == (len(ids), target.config.hidden_size)
    assert features.isfinite().all()
    block = drafter.config.block_size
    logits = drafter.draft_block(
        features, torch.arange(len(ids)), ids[-1], torch.arange(len(ids), len(ids) + block)
    )
    assert logits.shape == (block - 1, target.config.vocab_size)


def test_capture_rejects_what_does_not_fit(target):
    hidden = target.config.hidden_size
    with pytest.raises(ValueError, match="distinct"):
        HiddenCapture((1, 1), torch.empty(4, 2 * hidden))
    runner = PagedRunner(CapturingForward(target, _capture(target, (0, 3))), num_seqs=1)
    with pytest.raises(ValueError, match=r"layer_ids \[3\] outside the model's 3 layers"):
        runner.run({0: [1, 2]})
    runner = PagedRunner(CapturingForward(target, _capture(target)), num_seqs=1)
    with pytest.raises(ValueError, match="65 rows exceed the capture buffer's 64"):
        runner.run({0: list(range(65))})


@pytest.mark.gpu
def test_graph_replay_captures_into_the_static_buffer():
    from executor.graphs import DecodeGraphs
    from executor.kv_cache import KVCache
    from executor.model import AttnMetadata
    from executor.random_model import random_model

    dev = torch.device("cuda")
    model = random_model("qwen3-0.6b", device=dev, dtype=torch.bfloat16, max_position=2048)
    kv = KVCache.allocate(
        model.config, num_blocks=200, block_size=16, dtype=model.dtype, device=dev
    )
    for k, v in zip(kv.k, kv.v):
        k.normal_()
        v.normal_()
    layer_ids = (1, 13, model.config.num_layers - 1)
    hidden = model.config.hidden_size
    graph_capture = HiddenCapture.allocate(layer_ids, 32, hidden, dtype=model.dtype, device=dev)
    graphs = DecodeGraphs(
        model, kv.k, kv.v, max_seqs=8, max_blocks_per_seq=64, max_rows=32, capture=graph_capture
    )
    # three sequences: an AR row, a 4-row group, an AR row; block tables as wide as the graph's
    q_lens, ctx = [1, 4, 1], [90, 500, 33]
    pos, slots, cu, lens, tables = [], [], [0], [], []
    for s, (n, c) in enumerate(zip(q_lens, ctx)):
        table = [s * 64 + b for b in range(64)]
        tables.append(table)
        for p in range(c, c + n):
            pos.append(p)
            slots.append(table[p // 16] * 16 + p % 16)
        cu.append(len(pos))
        lens.append(c + n)
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
    meta = AttnMetadata(
        t(pos, torch.int64),
        t(slots, torch.int64),
        t(cu, torch.int32),
        t(lens, torch.int32),
        t(tables, torch.int32),
        max_q_len=4,
    )
    ids = torch.randint(0, model.config.vocab_size, (len(pos),), device=dev)
    eager_capture = HiddenCapture.allocate(layer_ids, 32, hidden, dtype=model.dtype, device=dev)
    model.forward(ids, meta, kv.k, kv.v, capture=eager_capture)
    for _ in range(2):  # the second replay overwrites the same static rows
        graphs.replay(16, ids, meta, max_q_len=4)
        got, want = graph_capture.rows(len(pos)).float(), eager_capture.rows(len(pos)).float()
        rel = (got - want).norm() / want.norm()
        assert rel < 1e-2, rel
