"""Block drafter (DFlash layout): loading beside a target, its forward against a reference written
from the description, and the one-line errors of checkpoints that do not fit the target."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.drafters.block_config import is_block_drafter_dir, load_block_drafter_config
from executor.drafters.block_model import load_block_drafter
from executor.loader import load_model
from executor.model_config import ModelLoadError
from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter
from tests.fixtures.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory, one_torch_thread):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("target"), "qwen3", seed=3))


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    return make_tiny_block_drafter(tmp_path_factory.mktemp("block"), target.config, seed=5)


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    """x [rows, heads, D] rotated in halves by angle position * theta^(-2i/D)."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = (positions.double()[:, None] * inv_freq[None, :]).float()  # [rows, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_block_logits(
    raw_config, sd, embed, lm_head, target_hidden, ctx_pos, last_token, positions
):
    """Straight from the description, fp32: features = norm(fc(concat)); the block
    [last, mask...] attends to context K/V and its own K/V without a causal mask."""
    eps, theta = raw_config["rms_norm_eps"], raw_config["rope_theta"]
    heads, kv_heads = raw_config["num_attention_heads"], raw_config["num_key_value_heads"]
    dim = raw_config["head_dim"]
    mask_id = raw_config["dflash_config"]["mask_token_id"]
    features = _rms(target_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    block_len = positions.shape[0]
    tokens = [last_token] + [mask_id] * (block_len - 1)
    h = torch.stack([embed[t] for t in tokens])  # [B, hidden]
    all_pos = torch.cat([ctx_pos, positions])
    for i in range(raw_config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, sd[p + "input_layernorm.weight"], eps)
        both = torch.cat([features, x])  # K/V sources: the context features, then the block
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(block_len, heads, dim)
        k = (both @ sd[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
        v = (both @ sd[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
        q = _rope(_rms(q, sd[p + "self_attn.q_norm.weight"], eps), positions, theta)
        k = _rope(_rms(k, sd[p + "self_attn.k_norm.weight"], eps), all_pos, theta)
        out = torch.zeros(block_len, heads, dim)
        for head in range(heads):
            kv_head = head // (heads // kv_heads)
            scores = torch.einsum("bd,sd->bs", q[:, head], k[:, kv_head]) / math.sqrt(dim)
            out[:, head] = torch.einsum("bs,sd->bd", scores.softmax(-1), v[:, kv_head])
        h = h + out.reshape(block_len, heads * dim) @ sd[p + "self_attn.o_proj.weight"].T
        x = _rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    out = _rms(h, sd["norm.weight"], eps)
    return out[1:] @ lm_head.T


def _inputs(target, num_ctx=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_features = target.config.num_layers
    target_hidden = torch.randn(num_ctx, num_features * target.config.hidden_size, generator=gen)
    ctx_pos = torch.arange(num_ctx)
    return target_hidden, ctx_pos


def test_detects_block_drafter_dirs(drafter_dir, target, tmp_path):
    assert is_block_drafter_dir(drafter_dir)
    assert not is_block_drafter_dir(make_tiny_model(tmp_path / "plain", "llama"))
    config = load_block_drafter_config(drafter_dir)
    assert config.target_layer_ids == (0, 1) and config.block_size == 4
    assert config.mask_token_id == target.config.vocab_size - 1


def test_forward_matches_reference(drafter_dir, target):
    drafter = load_block_drafter(drafter_dir, target)
    raw = json.loads((drafter_dir / "config.json").read_text())
    sd = load_file(str(drafter_dir / "model.safetensors"))
    target_hidden, ctx_pos = _inputs(target)
    features = drafter.project_context(target_hidden)
    # a full block right after the context, one further on, and a shorter block
    for last_token, start, block_len in ((7, 6, 4), (123, 9, 4), (40, 6, 3)):
        positions = torch.arange(start, start + block_len)
        logits = drafter.draft_block(features, ctx_pos, last_token, positions)
        expected = reference_block_logits(
            raw,
            sd,
            target.weights.embed,
            target.weights.lm_head,
            target_hidden,
            ctx_pos,
            last_token,
            positions,
        )
        assert logits.shape == (block_len - 1, target.config.vocab_size)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_shares_target_embedding_and_lm_head(drafter_dir, target):
    drafter = load_block_drafter(drafter_dir, target)
    assert drafter.weights.embed.data_ptr() == target.weights.embed.data_ptr()
    assert drafter.weights.lm_head.data_ptr() == target.weights.lm_head.data_ptr()


def test_sharded_checkpoint_loads_the_same(drafter_dir, target, tmp_path):
    sharded = make_tiny_block_drafter(tmp_path / "sharded", target.config, seed=5, sharded=True)
    assert not (sharded / "model.safetensors").exists()
    target_hidden, ctx_pos = _inputs(target, num_ctx=3)
    positions = torch.arange(3, 7)
    results = []
    for path in (drafter_dir, sharded):
        drafter = load_block_drafter(path, target)
        results.append(
            drafter.draft_block(drafter.project_context(target_hidden), ctx_pos, 5, positions)
        )
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


def _set(key, value):
    def edit(config):
        section = config["dflash_config"] if key in config["dflash_config"] else config
        section[key] = value

    return edit


def _drop(key):
    def edit(config):
        (config["dflash_config"] if key in config["dflash_config"] else config).pop(key)

    return edit


def _set_arch(config):
    config["architectures"] = ["DFlash2DraftModel"]


BAD_CONFIGS = [
    (_set("hidden_size", 32), "hidden_size"),
    (_set("vocab_size", 100000), "vocab_size"),
    (_set("target_layer_ids", [0, 2]), "target_layer_ids"),
    (_set("mask_token_id", 100000), "mask_token_id"),
    (_set("block_size", 1), "block_size"),
    (_set("num_target_layers", 36), "num_target_layers"),
    (_drop("target_layer_ids"), "target_layer_ids"),
    (_drop("mask_token_id"), "mask_token_id"),
    (_drop("block_size"), "block_size"),
    (_drop("hidden_size"), "hidden_size"),
    (_set_arch, "DFlash2DraftModel"),
    (_set("is_causal", True), "is_causal"),
    (_set("final_logit_softcapping", 20.0), "final_logit_softcapping"),
]


@pytest.mark.parametrize(("edit", "field"), BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_config_fails_with_one_line_naming_the_field(edit, field, target, tmp_path):
    path = make_tiny_block_drafter(tmp_path / "bad", target.config)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_block_drafter(path, target)
    message = str(err.value)
    assert field in message and "\n" not in message


def test_unknown_weights_fail(target, tmp_path):
    path = make_tiny_block_drafter(tmp_path / "extra", target.config, num_hidden_layers=1)
    config = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    sd["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 2, config["hidden_size"])

    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="attention_conv"):
        load_block_drafter(path, target)
