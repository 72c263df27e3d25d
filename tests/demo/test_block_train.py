"""The demo block drafter's training code: its states and block logits against the product's
forward, many masked blocks per sequence against blocks run alone, the KV-cached greedy
continuation against full recompute, and a `--small` training run end to end (CPU, tiny)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from executor.drafters.block_model import load_block_drafter
from executor.hidden_capture import HiddenCapture
from executor.kv_cache import KVCache
from executor.loader import load_model
from executor.model import AttnMetadata
from hipfire_serve.demo import block_train
from hipfire_serve.demo.block_drafter import (
    BlockDrafterShape,
    DemoBlockDrafter,
    load_trainable_block_drafter,
    save_block_drafter,
    target_states,
)
from hipfire_serve.demo.block_evaluate import load_demo_model
from hipfire_serve.demo.evaluate import greedy_generate
from hipfire_serve.demo.model import DemoCausalLM, DemoModelConfig

VOCAB = 512
LAYER_IDS = (0, 2)  # the last layer included: it is read after the final norm
BLOCK = 4
ATOL = 1e-4


def _write_demo_model(path, cfg: DemoModelConfig, seed: int):
    torch.manual_seed(seed)
    model = DemoCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so a mixed-up norm weight shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.hf_config([2, 0], 0)))
    save_file(model.hf_state_dict(), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    cfg = DemoModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return _write_demo_model(tmp_path_factory.mktemp("m") / "target", cfg, seed=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_demo_model(target_dir, "cpu")


@pytest.fixture(scope="module")
def shape():
    return BlockDrafterShape(
        vocab_size=VOCAB,
        hidden_size=64,
        num_target_layers=3,
        target_layer_ids=LAYER_IDS,
        block_size=BLOCK,
        mask_token_id=1,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256 + BLOCK,
    )


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target, shape):
    torch.manual_seed(5)
    drafter = DemoBlockDrafter(shape, target.model.embed_tokens.weight)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2)
            else:
                p.mul_(4.0)  # sharper attention than the init's, so a wrong mask shows
    return save_block_drafter(drafter, tmp_path_factory.mktemp("block"))


@pytest.fixture(scope="module")
def drafter(drafter_dir, target):
    return load_trainable_block_drafter(drafter_dir, target.model.embed_tokens.weight).eval()


def _ids(num: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (num,), generator=torch.Generator().manual_seed(seed))


def test_target_states_match_the_executor_capture(target_dir, target):
    """The layers the drafter trains on are those the serving forward captures."""
    model = load_model(target_dir, dtype="float32")
    ids = _ids(40, 1)
    kv = KVCache.allocate(
        model.config, num_blocks=4, block_size=16, dtype=torch.float32, device=torch.device("cpu")
    )
    meta = AttnMetadata(
        positions=torch.arange(40),
        slot_mapping=torch.arange(40),
        cu_q_lens=torch.tensor([0, 40], dtype=torch.int32),
        seq_lens=torch.tensor([40], dtype=torch.int32),
        block_tables=torch.arange(4, dtype=torch.int32)[None],
    )
    capture = HiddenCapture.allocate(LAYER_IDS, 40, 64, dtype=torch.float32, device=model.device)
    model.forward(ids, meta, kv.k, kv.v, capture=capture)
    with torch.no_grad():
        hidden, final = target_states(target, ids[None], LAYER_IDS)
    torch.testing.assert_close(hidden[0], capture.out, atol=ATOL, rtol=0)
    torch.testing.assert_close(final[0], hidden[0, :, 64:], atol=0, rtol=0)


def test_block_logits_match_the_product_forward(drafter_dir, target_dir, drafter):
    product = load_block_drafter(drafter_dir, load_model(target_dir, dtype="float32"))
    gen = torch.Generator().manual_seed(2)
    seq_len = 30
    target_hidden = torch.randn(seq_len, len(LAYER_IDS) * 64, generator=gen)
    ids = _ids(seq_len, 3)
    anchors = torch.tensor([[1, 9, 17, 26]])  # a block right after one context row, the last
    with torch.no_grad():
        features = drafter.project_context(target_hidden)
        torch.testing.assert_close(
            features, product.project_context(target_hidden), atol=ATOL, rtol=0
        )
        block = drafter(target_hidden[None], ids[None], anchors)[0]  # [K, B, hidden]
        logits = drafter.logits(block[:, 1:])  # [K, B - 1, vocab]
        for j, a in enumerate(anchors[0].tolist()):
            expected = product.draft_block(
                product.project_context(target_hidden[:a]),
                torch.arange(a),
                int(ids[a]),
                torch.arange(a, a + BLOCK),
            )
            torch.testing.assert_close(logits[j], expected, atol=ATOL, rtol=0)


def test_many_blocks_in_one_pass_match_each_block_alone(drafter):
    gen = torch.Generator().manual_seed(4)
    num, seq_len = 2, 24
    target_hidden = torch.randn(num, seq_len, len(LAYER_IDS) * 64, generator=gen)
    ids = torch.stack([_ids(seq_len, 5), _ids(seq_len, 6)])
    anchors = torch.tensor([[3, 4, 12, 20], [0, 7, 7, 19]])  # overlapping and repeated blocks
    with torch.no_grad():
        together = drafter(target_hidden, ids, anchors)  # [N, K, B, hidden]
        features = drafter.project_context(target_hidden)  # [N, T, hidden]
        for n in range(num):
            for j, a in enumerate(anchors[n].tolist()):
                # alone: only the context before the anchor exists, and one block
                block_ids = torch.full((1, BLOCK), drafter.shape.mask_token_id)
                block_ids[0, 0] = ids[n, a]
                alone = drafter.block_hidden(
                    features[n : n + 1, :a],
                    torch.arange(a)[None],
                    block_ids,
                    torch.arange(a, a + BLOCK)[None],
                    torch.ones(1, BLOCK, a + BLOCK, dtype=torch.bool),
                )
                torch.testing.assert_close(together[n, j], alone[0], atol=ATOL, rtol=0)


def test_kv_cached_greedy_matches_full_recompute(target):
    prompts = torch.stack([_ids(20, 7), _ids(20, 8)])
    got = block_train.greedy_continue(target, prompts, 12)
    torch.testing.assert_close(got, greedy_generate(target, prompts, 12), atol=0, rtol=0)


def _write_corpus(path) -> None:
    """Token streams with repeated 'lines' (so there is something to learn), no separators."""
    rng = np.random.default_rng(0)
    lines = rng.integers(3, VOCAB, size=(40, 12))
    for kind in ("code", "prose"):
        for split, num in (("train", 400), ("val", 60)):
            stream = lines[rng.integers(0, len(lines), size=num)].reshape(-1)
            np.save(path / f"{kind}_{split}.npy", stream.astype(np.uint16))
    manifest = {
        "vocab_size": VOCAB,
        "special_token_ids": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
    }
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_small_training_run_learns_and_loads_in_the_product(tmp_path, target_dir):
    draft_cfg = DemoModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    draft_dir = _write_demo_model(tmp_path / "draft", draft_cfg, seed=9)
    data = tmp_path / "data"
    data.mkdir()
    _write_corpus(data)
    out = tmp_path / "out"
    args = ["--data", str(data), "--target", str(target_dir), "--draft", str(draft_dir)]
    args += ["--out", str(out), "--small", "--seconds", "3", "--device", "cpu"]
    assert block_train.main(args) == 0
    record = json.loads((out / "record.json").read_text())
    train_log, val_log = record["log"]["train"], record["log"]["val"]
    assert train_log[-1]["loss"] < train_log[0]["loss"]
    assert val_log[-1]["code_loss"] < val_log[0]["code_loss"]
    for kind in ("code", "prose"):
        depth = record["acceptance"][kind][f"depth_{record['shape']['block_size']}"]
        assert set(depth) == {"block", "draft-model", "ngram"}
        assert depth["block"]["mean_accepted_len"] >= 1.0
    product = load_block_drafter(out, load_model(target_dir, dtype="float32"))
    assert product.config.target_layer_ids == tuple(record["shape"]["target_layer_ids"])
    assert product.config.mask_token_id == 1
    features = product.project_context(torch.randn(5, product.weights.fc.shape[1]))
    block_size = product.config.block_size
    logits = product.draft_block(features, torch.arange(5), 7, torch.arange(5, 5 + block_size))
    assert logits.shape == (block_size - 1, VOCAB) and torch.isfinite(logits).all()
