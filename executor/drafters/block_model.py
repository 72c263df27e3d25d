"""A block drafter (DFlash layout): weights loaded beside a target, and its forward in plain torch.

Weights (z-lab/dflash's `DFlashDraftModel` and its safetensors header fixture, no `model.`
prefix): `fc.weight [hidden, len(target_layer_ids) * hidden]`, `hidden_norm.weight`,
`layers.{i}.` with Qwen3 decoder names (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`) and `norm.weight`.
There is no embedding and no lm_head: both are the target's, shared here by reference.
Forward (z-lab/dflash `dflash/model.py`, the DFlash paper, SGLang's DFlash worker):
context features = hidden_norm(fc(concat of the target's hidden states after each layer of
`target_layer_ids`)) for the verified context; the block [last verified token, mask x (B-1)] is
embedded with the target's embedding; in every layer the block's queries attend, without a
causal mask, to keys/values projected from the context features (k_proj/v_proj applied to the
features directly, no input norm) followed by the block's own; RoPE at the absolute positions.
The last B-1 rows of the final norm go through the target's lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor.drafters.block_config import (
    BlockDrafterConfig,
    check_against_target,
    load_block_drafter_config,
)
from executor.loader import read_state_dict, take_weight
from executor.model import Model
from executor.model_config import ModelLoadError
from executor.ops import reference_ops
from executor.rope import build_cos_sin_cache
from kernels.norms import head_rms_norm_ref

# Weights a checkpoint may carry but the drafter takes from the target instead.
TARGET_OWNED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


@dataclass(frozen=True)
class BlockLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]; context rows use the kv part only
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass(frozen=True)
class BlockDrafterWeights:
    fc: torch.Tensor  # [hidden, len(target_layer_ids) * hidden]
    hidden_norm: torch.Tensor  # [hidden]
    layers: tuple[BlockLayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    embed: torch.Tensor  # [vocab, hidden]: the target's own tensor
    lm_head: torch.Tensor  # [vocab, hidden]: the target's own tensor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] rotated over its first rot_dim dims in halves (neox); cos/sin [n, rot_dim/2]."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


class BlockDrafter:
    """One request's block drafting; batching over requests and paged context KV come later."""

    def __init__(
        self,
        config: BlockDrafterConfig,
        weights: BlockDrafterWeights,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.ops = reference_ops()
        self.cos_sin = build_cos_sin_cache(
            config.decoder.rope, config.decoder.head_dim, config.decoder.max_position, device
        )  # [max_position, rot_dim]
        self.scale = config.decoder.head_dim**-0.5

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden [n, len(target_layer_ids) * hidden] (the chosen layers' outputs side by
        side, in target_layer_ids order) -> context features [n, hidden]."""
        fc = torch.nn.functional.linear(target_hidden, self.weights.fc)
        return self.ops.rms_norm(fc, self.weights.hidden_norm, self.config.decoder.rms_norm_eps)

    def draft_block(
        self,
        context_features: torch.Tensor,  # [n, hidden]
        context_positions: torch.Tensor,  # [n] int64
        last_token: int,
        positions: torch.Tensor,  # [block_size] int64: the block's absolute positions
    ) -> torch.Tensor:
        """Returns the logits [B - 1, vocab] float32 of the block's masked positions, B =
        len(positions) (at most config.block_size: a shorter block drafts fewer tokens)."""
        cfg, w, ops = self.config, self.weights, self.ops
        dec = cfg.decoder
        linear = torch.nn.functional.linear
        block_size = positions.shape[0]
        num_ctx = context_features.shape[0]
        assert 2 <= block_size <= cfg.block_size, (block_size, cfg.block_size)
        assert context_features.shape == (num_ctx, dec.hidden_size), context_features.shape
        assert context_positions.shape == (num_ctx,), context_positions.shape
        tokens = torch.full((block_size,), cfg.mask_token_id, dtype=torch.long, device=self.device)
        tokens[0] = last_token
        hidden = w.embed[tokens]  # [B, hidden]
        ctx_cos_sin = self.cos_sin[context_positions]  # [n, rot_dim]
        blk_cos_sin = self.cos_sin[positions]  # [B, rot_dim]
        half = self.cos_sin.shape[1] // 2
        kv_cos, kv_sin = torch.cat([ctx_cos_sin, blk_cos_sin]).split(half, dim=-1)
        q_cos, q_sin = blk_cos_sin.split(half, dim=-1)
        group = dec.num_q_heads // dec.num_kv_heads
        for lw in w.layers:
            x = ops.rms_norm(hidden, lw.input_norm, dec.rms_norm_eps)  # [B, hidden]
            qkv = linear(x, lw.qkv, lw.qkv_bias)  # [B, q + 2 kv]
            kv_weight = lw.qkv[dec.q_size :]  # a view: context rows need no query
            kv_bias = None if lw.qkv_bias is None else lw.qkv_bias[dec.q_size :]
            ctx_kv = linear(context_features, kv_weight, kv_bias)  # [n, 2 kv]
            kv = torch.cat([ctx_kv, qkv[:, dec.q_size :]])  # [n + B, 2 kv]
            q = qkv[:, : dec.q_size].reshape(block_size, dec.num_q_heads, dec.head_dim)
            k = kv[:, : dec.kv_size].reshape(num_ctx + block_size, dec.num_kv_heads, dec.head_dim)
            v = kv[:, dec.kv_size :].reshape(num_ctx + block_size, dec.num_kv_heads, dec.head_dim)
            q = _rotate(head_rms_norm_ref(q, lw.q_norm, dec.rms_norm_eps), q_cos, q_sin)
            k = _rotate(head_rms_norm_ref(k, lw.k_norm, dec.rms_norm_eps), kv_cos, kv_sin)
            # Every block row sees the whole context and the whole block: no causal mask.
            k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [Hq, n + B, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
            scores = q.transpose(0, 1).float() @ k.transpose(1, 2) * self.scale  # [Hq, B, n + B]
            attn = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(self.dtype)  # [B, Hq, D]
            hidden = hidden + linear(attn.reshape(block_size, dec.q_size), lw.o_proj)
            x = ops.rms_norm(hidden, lw.post_norm, dec.rms_norm_eps)
            hidden = hidden + linear(ops.silu_and_mul(linear(x, lw.gate_up)), lw.down)
        out = ops.rms_norm(hidden[1:], w.final_norm, dec.rms_norm_eps)  # [B - 1, hidden]
        return linear(out, w.lm_head).float()


def load_block_weights(
    model_dir: Path, config: BlockDrafterConfig, target: Model
) -> BlockDrafterWeights:
    sd = read_state_dict(model_dir)

    def t(name: str) -> torch.Tensor:
        return take_weight(sd, name).to(device=target.device, dtype=target.dtype).contiguous()

    decoder = config.decoder
    fc = t("fc.weight")
    expected_fc = (
        decoder.hidden_size,
        len(config.target_layer_ids) * decoder.hidden_size,
    )
    if tuple(fc.shape) != expected_fc:
        raise ModelLoadError(
            f"block drafter weight fc.weight has shape {list(fc.shape)}, expected "
            f"{list(expected_fc)} for {len(config.target_layer_ids)} target layers"
        )
    layers = []
    for i in range(decoder.num_layers):
        p = f"layers.{i}."
        attn = [t(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        qkv_bias = None
        if decoder.qkv_bias:
            qkv_bias = torch.cat([t(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
        layers.append(
            BlockLayerWeights(
                input_norm=t(p + "input_layernorm.weight"),
                qkv=torch.cat(attn),
                qkv_bias=qkv_bias,
                q_norm=t(p + "self_attn.q_norm.weight"),
                k_norm=t(p + "self_attn.k_norm.weight"),
                o_proj=t(p + "self_attn.o_proj.weight"),
                post_norm=t(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]),
                down=t(p + "mlp.down_proj.weight"),
            )
        )
    final_norm = t("norm.weight")
    hidden_norm = t("hidden_norm.weight")
    unexpected = sorted(name for name in sd if name not in TARGET_OWNED_WEIGHTS)
    if unexpected:
        raise ModelLoadError(
            f"block drafter checkpoint holds {len(unexpected)} unexpected weights, e.g. "
            f"{unexpected[0]!r} (a layout this loader does not know)"
        )
    return BlockDrafterWeights(
        fc=fc,
        hidden_norm=hidden_norm,
        layers=tuple(layers),
        final_norm=final_norm,
        embed=target.weights.embed,
        lm_head=target.weights.lm_head,
    )


def load_block_drafter(model_dir: Path | str, target: Model) -> BlockDrafter:
    """Loads a block drafter for `target` in the target's dtype and on its device."""
    model_dir = Path(model_dir)
    config = load_block_drafter_config(model_dir)
    check_against_target(config, target.config)
    weights = load_block_weights(model_dir, config, target)
    return BlockDrafter(config, weights, device=target.device, dtype=target.dtype)
