"""Random-weight block drafters of real shapes: the presets' configs against their targets, the
weights beside a random target, and the engine running one as the cost-bearing inner drafter of
the synthetic drafter (captures and KV reserved as for a real block drafter)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from executor.drafters.random_block import (
    BLOCK_PRESETS,
    block_preset_config,
    random_block_drafter,
)
from executor.drafters.synthetic import SyntheticDrafter
from executor.random_model import PRESETS, random_model

ACCEPTANCE = Path(__file__).resolve().parents[2] / "scheduler" / "profiles" / "acceptance.json"


@pytest.fixture(scope="module")
def tiny_target(one_torch_thread):
    return random_model("tiny", device=torch.device("cpu"), dtype=torch.float32, max_position=256)


def test_the_qwen3_8b_preset_has_the_released_drafters_shape():
    target = SimpleNamespace(config=PRESETS["qwen3-8b"], max_position=4096)
    cfg = block_preset_config("qwen3-8b-dflash", target)
    dec = cfg.decoder
    assert (dec.num_layers, dec.hidden_size, dec.intermediate_size) == (5, 4096, 12288)
    assert (dec.num_q_heads, dec.num_kv_heads, dec.head_dim) == (32, 8, 128)
    assert dec.qk_norm and not dec.qkv_bias and dec.vocab_size == 151936
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_target_layers == 36
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_drafts) == (16, 151669, 15)
    assert dec.max_position == 4096 + 16  # a block past the target's last position


def test_a_preset_refuses_a_target_it_does_not_fit(tiny_target):
    with pytest.raises(ValueError, match="num_target_layers=36"):
        random_block_drafter(tiny_target, "qwen3-8b-dflash")
    with pytest.raises(ValueError, match="unknown random block drafter 'nope'"):
        random_block_drafter(tiny_target, "nope")


def test_weights_sit_beside_the_target_and_share_its_embedding(tiny_target):
    model = random_block_drafter(tiny_target, "tiny-dflash", seed=1)
    cfg, w = model.config, model.weights
    dec = cfg.decoder
    assert cfg == block_preset_config("tiny-dflash", tiny_target)
    assert w.embed is tiny_target.weights.embed and w.lm_head is tiny_target.weights.lm_head
    assert tuple(w.fc.shape) == (dec.hidden_size, len(cfg.target_layer_ids) * dec.hidden_size)
    assert len(w.layers) == BLOCK_PRESETS["tiny-dflash"].num_layers
    layer = w.layers[0]
    assert tuple(layer.qkv.shape) == (dec.q_size + 2 * dec.kv_size, dec.hidden_size)
    assert tuple(layer.gate_up.shape) == (2 * dec.intermediate_size, dec.hidden_size)
    assert model.dtype == tiny_target.dtype and model.device == tiny_target.device
    # seeded: the same weights again, other ones for another seed
    again = random_block_drafter(tiny_target, "tiny-dflash", seed=1)
    other = random_block_drafter(tiny_target, "tiny-dflash", seed=2)
    assert torch.equal(again.weights.fc, w.fc) and not torch.equal(other.weights.fc, w.fc)
    # its block forward gives finite logits of the masked positions
    num_ctx = 5
    features = model.project_context(
        torch.randn(num_ctx, len(cfg.target_layer_ids) * dec.hidden_size)
    )
    logits = model.draft_block(
        features, torch.arange(num_ctx), 7, torch.arange(num_ctx, num_ctx + cfg.block_size)
    )
    assert logits.shape == (cfg.block_size - 1, dec.vocab_size) and logits.isfinite().all()


def test_a_synthetic_drafter_passes_the_block_drafters_hooks_on():
    class Block:
        capture_layer_ids = (0, 1)
        kv_lookahead = 7

        def __init__(self):
            self.writes = []

        def extend_context(self, hidden, positions, slot_mapping):
            self.writes.append(len(positions))

    inner = Block()
    synth = SyntheticDrafter(ACCEPTANCE, "code", inner=inner)
    assert synth.capture_layer_ids == (0, 1) and synth.kv_lookahead == 7
    synth.extend_context(torch.zeros(3, 4), torch.arange(3), torch.arange(3))
    assert inner.writes == [3]
    bare = SyntheticDrafter(ACCEPTANCE, "code")
    assert bare.capture_layer_ids is None and bare.kv_lookahead == 0
    bare.extend_context(torch.zeros(3, 4), torch.arange(3), torch.arange(3))  # a no-op


def _engine(draft: str, cost_drafter: str = "none"):
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    return Engine(
        EngineConfig(
            model="random:tiny",
            draft=draft,
            allow_synthetic_draft=True,
            synthetic_cost_drafter=cost_drafter,
            acceptance_profile=f"{ACCEPTANCE}:code",
            spec_mode="spec" if draft != "none" else "ar",
            spec_depth=4,
            max_concurrency=2,
            max_model_len=128,
            kv_cache_memory="8MiB",
            device="cpu",
            dtype="float32",
        )
    )


def test_the_engine_runs_a_random_block_drafter_as_the_synthetic_drafters_cost(monkeypatch):
    from executor.drafters.block_drafter import BlockDrafter
    from hipfire_serve.types import SamplingParams

    engine = _engine("synthetic", "random-block:tiny-dflash")
    synth = engine.drafter
    assert synth.name == "synthetic" and isinstance(synth.inner, BlockDrafter)
    # the executor captures for it and the scheduler holds KV for its whole block
    assert engine.executor.capture.layer_ids == BLOCK_PRESETS["tiny-dflash"].target_layer_ids
    lookahead = BLOCK_PRESETS["tiny-dflash"].block_size - 1
    assert engine.scheduler.config.draft_kv_lookahead == lookahead
    assert synth.inner.block_tables is engine.executor.table.block_tables
    writes, proposals = [], []
    monkeypatch.setattr(
        synth.inner, "extend_context", lambda h, p, s: writes.append(int(p.shape[0]))
    )
    propose = synth.inner.propose
    monkeypatch.setattr(
        synth.inner, "propose", lambda r, g, defer=False: proposals.append(len(r)) or propose(r, g)
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 30)), params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert len(tokens) == 12
    assert writes and proposals  # every forward wrote its context, speculating rounds drafted
    # the block drafter runs for its cost only: its context and block K/V, written under the
    # target's block ids, leave the target's tokens as a synthetic drafter without it has them
    free = _engine("synthetic")
    assert free.executor.capture is None and free.scheduler.config.draft_kv_lookahead == 0
    free.add_request("a", list(range(1, 30)), params)
    free_outs = []
    while free.has_unfinished():
        free_outs += free.step()
    assert tokens == [t for o in free_outs for c in o.outputs for t in c.token_ids]


def test_a_random_block_drafter_serves_as_the_drafter_itself():
    from executor.drafters.block_drafter import BlockDrafter

    engine = _engine("random-block:tiny-dflash")
    assert isinstance(engine.drafter, BlockDrafter)
    assert engine.scheduler.config.draft_kv_lookahead == 7
