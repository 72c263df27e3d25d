"""A hybrid target's memory shape: KV only for its full-attention layers, the compact state
journal, the random-weight presets of real Qwen3.5 shapes, and decode graphs refused for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.graphs import DecodeGraphs
from executor.kv_cache import KVCache
from executor.random_model import PRESETS, random_model
from executor.recurrent_state import RecurrentStates
from tests.executor.test_hybrid_model import BLOCK, Runner

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "qwen3.5-27b"])
def test_kv_is_kept_only_by_the_full_attention_layers(name):
    cfg = PRESETS[name]
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert cfg.kv_layer_ids == tuple(full) and len(full) == cfg.num_layers // 4
    for dtype, elt in ((torch.bfloat16, 2), (torch.float32, 4)):
        per_token = len(full) * 2 * cfg.num_kv_heads * cfg.head_dim * elt
        assert cfg.kv_bytes_per_token(elt) == per_token
        budget = 10 * BLOCK * per_token + per_token  # ten blocks and a bit
        assert KVCache.blocks_for_budget([cfg], budget, BLOCK, dtype) == 10
    if name == "tiny-qwen3.5":
        kv = KVCache.allocate(cfg, num_blocks=3, block_size=BLOCK, dtype=torch.float32, device=CPU)
        assert len(kv.k) == len(kv.v) == len(full)
        assert kv.num_bytes == 3 * BLOCK * cfg.kv_bytes_per_token(4)


def test_dense_models_keep_kv_in_every_layer():
    cfg = PRESETS["qwen3-8b"]
    assert cfg.kv_layer_ids == tuple(range(36))
    assert cfg.kv_bytes_per_token(2) == 36 * 2 * 8 * 128 * 2


def test_qwen3_5_27b_preset_is_the_released_shape_and_fits_one_h200():
    cfg = PRESETS["qwen3.5-27b"]
    la = cfg.linear_attn
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (5120, 64, 17408)
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (24, 4, 256)
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim) == (
        16,
        48,
        128,
        128,
    )
    assert la.conv_kernel == 4 and cfg.attn_output_gate and cfg.rope.rotary_dim == 64
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert len(cfg.linear_layer_ids) == 48 and cfg.vocab_size == 248320
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    full = (2 * q + 2 * kv) * h + h * q  # q | k | v | gate, o_proj
    linear = (la.conv_dim + la.value_dim + 2 * la.num_value_heads) * h + h * la.value_dim
    params = 16 * full + 48 * linear + 64 * 3 * h * cfg.intermediate_size + 2 * cfg.vocab_size * h
    assert 26.8e9 < params < 27.0e9
    weights = 2 * params
    state = RecurrentStates.bytes_per_slot(cfg, 2)
    journal = 64 * 8 * RecurrentStates.journal_bytes_per_row(cfg, 2)  # 64 groups of 8 rows
    kv = cfg.max_position * cfg.kv_bytes_per_token(2)  # one request of the whole context
    # bf16 weights (53.8 GB), 64 slots of state (9.9 GB) and their journal (1.3 GB) leave an
    # H200 room for the KV of three requests of the whole 262k context (17.2 GB each)
    assert weights + 64 * state + journal + 3 * kv < 141e9 * 0.95


def test_compact_journal_is_sixty_times_smaller_at_the_27b_shape():
    cfg = PRESETS["qwen3.5-27b"]
    la = cfg.linear_attn
    compact = RecurrentStates.journal_bytes_per_row(cfg, 2)
    full = RecurrentStates.journal_bytes_per_row(cfg, 2, compact=False)
    assert compact == 48 * (la.conv_dim * 2 + (16 * 128 + 48 + 48 * 128) * 4) == 2_565_120
    assert full == RecurrentStates.bytes_per_slot(cfg, 2) == 153_944_064
    assert full > 60 * compact


def test_a_round_allocates_the_compact_journal():
    model = random_model("tiny-qwen3.5", device=CPU, dtype=torch.float32)
    states = RecurrentStates.for_model(model, 3)
    rs = states.begin_round(1, np.array([2, 0, 1]), np.array([0, 5, 6, 9]), np.array([4, 0, 2]))
    journal = (rs.conv_journal, rs.k_journal, rs.g_journal, rs.u_journal)
    assert sum(t.numel() * t.element_size() for t in journal) == 8 * (
        RecurrentStates.journal_bytes_per_row(model.config, 4)
    )  # 5 + 3 rows of the two SPEC groups
    states.commit(1, np.ones(3, bool), np.array([4, 0, 2]))
    assert states.num_pending_journals == 0


def test_tiny_random_hybrid_decodes_as_it_prefills():
    """The tiny preset's random weights through the hybrid forward: a prompt in one chunk
    gives the logits of the same prompt fed as a chunk, a SPEC group committed in part and
    AR rows (finite, and not flat)."""
    model = random_model("tiny-qwen3.5", device=CPU, dtype=torch.float32)
    ids = torch.randint(1, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = Runner(model, 1).run({0: ids})[0]
    assert torch.isfinite(ref).all() and ref.std(-1).min() > 0.1
    r = Runner(model, 1)
    got = [r.run({0: ids[:20]})[0]]
    got.append(r.run({0: ids[20:26]}, drafts={0: 5})[0][:3])
    r.commit([0], [2])
    got += [r.run({0: [t]})[0] for t in ids[23:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)


def test_decode_graphs_are_refused_for_hybrid_targets():
    model = random_model("tiny-qwen3.5", device=CPU, dtype=torch.float32)
    kv = KVCache.for_model(model, num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="recurrent"):
        DecodeGraphs(model, kv.k, kv.v, max_seqs=2, max_blocks_per_seq=2, max_rows=4)
