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

Quantized checkpoints load through the target's loader code: `quantization_config` is read by
`executor.quant.scheme` (what it does not support is refused in one line naming the
quant_method) and every linear layer (fc, the projections) is taken by
`executor.quant.linear_loader`, so fp8, gptq, awq and compressed-tensors drafters keep the
formats a target keeps. GGUF has no names for a block drafter's tensors and is refused.
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
from executor.kv_scales import take_kv_scales
from executor.loader import read_state_dict, take_weight
from executor.model import AttnMetadata, LayerWeights, Model, ModelWeights
from executor.model_config import ModelLoadError
from executor.ops import reference_ops
from executor.quant.linear import QuantLinear, quant_linear, weight_nbytes
from executor.quant.linear_loader import fuse_linears, linear_shape, take_one
from executor.quant.scheme import read_quant_scheme
from executor.rope import build_cos_sin_cache
from kernels.norms import head_rms_norm_ref

# Weights a checkpoint may carry but the drafter takes from the target instead.
TARGET_OWNED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


@dataclass(frozen=True)
class BlockDrafterWeights:
    fc: torch.Tensor | QuantLinear  # [hidden, len(target_layer_ids) * hidden]
    hidden_norm: torch.Tensor  # [hidden]
    # The drafter's layers and final norm with the target's embedding and lm_head (the
    # target's own tensors, not copies); a layer's qkv serves context rows by its k/v part.
    decoder: ModelWeights
    # Every layer's k/v projection side by side [layers * 2 kv, hidden]; None: sliced from
    # the dense qkv weights (a packed weight cannot be sliced by rows, so a quantized
    # checkpoint's loader fuses the layers' k/v parts itself).
    context_kv: torch.Tensor | QuantLinear | None = None

    @property
    def layers(self) -> tuple[LayerWeights, ...]:
        return self.decoder.layers

    @property
    def final_norm(self) -> torch.Tensor:
        return self.decoder.final_norm

    @property
    def embed(self) -> torch.Tensor:
        return self.decoder.embed

    @property
    def lm_head(self) -> torch.Tensor:
        return self.decoder.lm_head


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] rotated over its first rot_dim dims in halves (neox); cos/sin [n, rot_dim/2]."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


class BlockDraftModel:
    """A block drafter's weights beside its target and its three computations: the batched,
    paged ones the executor runs (`write_context`: context K/V from captured target states;
    `block_logits`: one forward of every speculating request's block, the decoder's `Model`
    with non-causal attention) and `draft_block`, one request in plain torch (the reference,
    no cache)."""

    def __init__(
        self,
        config: BlockDrafterConfig,
        weights: BlockDrafterWeights,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_position: int | None = None,
        ops_backend: str = "auto",
    ):
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.ops = reference_ops()
        dec = config.decoder
        self.cos_sin = build_cos_sin_cache(
            dec.rope, dec.head_dim, dec.max_position, device
        )  # [max_position, rot_dim]
        self.scale = dec.head_dim**-0.5
        # The paged path: the drafter's layers as a decoder over the target's embedding.
        self.decoder = Model(
            dec,
            weights.decoder,
            device=device,
            dtype=dtype,
            ops_backend=ops_backend,
            max_position=max(max_position or 0, dec.max_position),
        )
        # Context rows need only keys and values: every layer's k/v projection in one GEMM.
        self.context_kv = weights.context_kv
        if self.context_kv is None:
            self.context_kv = torch.cat([lw.qkv[dec.q_size :] for lw in weights.layers])
        self.context_kv_bias = None
        if dec.qkv_bias:
            self.context_kv_bias = torch.cat([lw.qkv_bias[dec.q_size :] for lw in weights.layers])
        # fc and the context k/v lie outside the decoder's weights: a packed one needs the
        # quantized route even where the decoder's layers are all dense
        self._context_linear = self.decoder._linear()
        packed = (self.weights.fc, self.context_kv)
        if not self.decoder.quantized and any(isinstance(w, QuantLinear) for w in packed):
            self._context_linear = quant_linear(self._context_linear, self.decoder.ops.kernels)

    @property
    def weight_bytes(self) -> int:
        """Device bytes of the drafter's own weights, packed ones at their packed size (the
        target's embedding and lm_head, shared, are the target's)."""
        w = self.weights
        tensors = [w.fc, w.hidden_norm, w.final_norm, self.context_kv]
        for lw in w.layers:
            tensors += [t for t in vars(lw).values() if isinstance(t, torch.Tensor | QuantLinear)]
        if self.context_kv_bias is not None:
            tensors.append(self.context_kv_bias)
        return sum(weight_nbytes(t) for t in tensors)

    def write_context(
        self,
        target_hidden: torch.Tensor,  # [n, len(target_layer_ids) * hidden] captured states
        positions: torch.Tensor,  # [n] int64
        slot_mapping: torch.Tensor,  # [n] int64, < 0: skip the row
        k_caches: list[torch.Tensor],  # per drafter layer [blocks, page, Hkv, D]
        v_caches: list[torch.Tensor],
    ) -> None:
        """Projects target states to context features and stores every drafter layer's context
        K/V (k_norm and RoPE applied) at the rows' cache slots."""
        dec, ops = self.config.decoder, self.decoder.ops
        linear = self._context_linear
        features = ops.rms_norm(
            linear(target_hidden, self.weights.fc), self.weights.hidden_norm, dec.rms_norm_eps
        )  # [n, hidden]
        kv = linear(features, self.context_kv, self.context_kv_bias)  # [n, layers * 2 kv]
        width = 2 * dec.kv_size
        plan = {}
        if ops.forward_plan is not None:  # the layers share the rows' RoPE and slots
            plan["plan"] = ops.forward_plan(positions, slot_mapping, self.decoder.cos_sin)
        for i, lw in enumerate(self.weights.layers):
            ops.qk_norm_rope_and_write_kv(
                kv[:, i * width : (i + 1) * width],
                lw.q_norm,
                lw.k_norm,
                dec.rms_norm_eps,
                positions,
                self.decoder.cos_sin,
                slot_mapping,
                k_caches[i],
                v_caches[i],
                num_q_heads=0,
                is_neox=True,
                k_scale=self.decoder.kv_scales.k[i],
                v_scale=self.decoder.kv_scales.v[i],
                **plan,
            )

    def block_logits(
        self,
        ids: torch.Tensor,  # [rows] every block's tokens: the last verified one, then masks
        meta: AttnMetadata,  # one sequence per block, its rows at the block's positions
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        draft_rows: torch.Tensor,  # [E] rows whose logits are wanted (the drafts to verify)
    ) -> torch.Tensor:
        """One forward of all blocks (their K/V written past the context, where the next
        context write overwrites them); float32 logits of `draft_rows` [E, vocab]."""
        hidden = self.decoder.forward(ids, meta, k_caches, v_caches, causal=False)
        return self.decoder.logits(hidden[draft_rows])

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden [n, len(target_layer_ids) * hidden] (the chosen layers' outputs side by
        side, in target_layer_ids order) -> context features [n, hidden]."""
        fc = quant_linear(torch.nn.functional.linear, False)(target_hidden, self.weights.fc)
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
        linear = quant_linear(torch.nn.functional.linear, False)
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
            if isinstance(lw.qkv, QuantLinear):  # packed rows cannot be sliced: all outputs
                ctx_kv = linear(context_features, lw.qkv, lw.qkv_bias)[:, dec.q_size :]
            else:
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


def _refuse_gguf(model_dir: Path) -> None:
    """A block drafter's weights come from safetensors: GGUF names no fc, hidden_norm or
    context layers, so a directory holding only a .gguf is refused by its format."""
    if any(model_dir.glob("*.safetensors")) or not any(model_dir.glob("*.gguf")):
        return
    path = sorted(model_dir.glob("*.gguf"))[0]
    formats = "gguf"
    try:
        from executor.gguf.files import GGUFMetadata

        names = {t.tensor_type.name for t in GGUFMetadata(path).reader.tensors if len(t.shape) > 1}
        formats = "gguf " + "/".join(sorted(names)) if names else formats
    except (ModelLoadError, ImportError):
        pass  # the refusal names the format without the block types
    raise ModelLoadError(
        f"block drafter {path.name}: quant_method {formats!r} is not supported for block "
        "drafters (GGUF has no names for their fc and context layers; serve the safetensors "
        "checkpoint, dense or fp8 / gptq / awq / compressed-tensors)"
    )


def load_block_weights(
    model_dir: Path, config: BlockDrafterConfig, target: Model
) -> BlockDrafterWeights:
    _refuse_gguf(model_dir)
    scheme = read_quant_scheme(model_dir)  # refuses what it does not support, before weights
    sd = read_state_dict(model_dir)
    device, dtype = target.device, target.dtype

    def t(name: str) -> torch.Tensor:
        return take_weight(sd, name).to(device=device, dtype=dtype).contiguous()

    def lin(prefix: str):  # dense [N, K] or a QuantLinear, as the target's layers load
        return take_one(sd, prefix, scheme, dtype, device)

    decoder = config.decoder
    fc = lin("fc")
    expected_fc = (
        decoder.hidden_size,
        len(config.target_layer_ids) * decoder.hidden_size,
    )
    if linear_shape(fc) != expected_fc:
        raise ModelLoadError(
            f"block drafter weight fc.weight has shape {list(linear_shape(fc))}, expected "
            f"{list(expected_fc)} for {len(config.target_layer_ids)} target layers"
        )
    layers, context_kv = [], []
    for i in range(decoder.num_layers):
        p = f"layers.{i}."
        q, k, v = (lin(p + f"self_attn.{n}_proj") for n in ("q", "k", "v"))
        context_kv += [k, v]
        qkv_bias = None
        if decoder.qkv_bias:
            qkv_bias = torch.cat([t(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
        layers.append(
            LayerWeights(
                input_norm=t(p + "input_layernorm.weight"),
                qkv=fuse_linears([q, k, v]),
                qkv_bias=qkv_bias,
                q_norm=t(p + "self_attn.q_norm.weight"),
                k_norm=t(p + "self_attn.k_norm.weight"),
                o_proj=lin(p + "self_attn.o_proj"),
                post_norm=t(p + "post_attention_layernorm.weight"),
                gate_up=fuse_linears([lin(p + "mlp.gate_proj"), lin(p + "mlp.up_proj")]),
                down=lin(p + "mlp.down_proj"),
            )
        )
    final_norm = t("norm.weight")
    hidden_norm = t("hidden_norm.weight")
    kv_scales = take_kv_scales(sd, decoder, device, prefix="layers.")
    unexpected = sorted(name for name in sd if name not in TARGET_OWNED_WEIGHTS)
    if unexpected:
        raise ModelLoadError(
            f"block drafter checkpoint holds {len(unexpected)} unexpected weights, e.g. "
            f"{unexpected[0]!r} (a layout this loader does not know)"
        )
    decoder_weights = ModelWeights(
        embed=target.weights.embed,
        layers=tuple(layers),
        final_norm=final_norm,
        lm_head=target.weights.lm_head,
        kv_scales=kv_scales,
    )
    packed_kv = None
    if any(isinstance(w, QuantLinear) for w in context_kv):
        try:
            packed_kv = fuse_linears(context_kv)
        except ModelLoadError:  # act-order differing by layer: one dense GEMM instead
            packed_kv = torch.cat(
                [w.dequantize() if isinstance(w, QuantLinear) else w for w in context_kv]
            )
    return BlockDrafterWeights(
        fc=fc, hidden_norm=hidden_norm, decoder=decoder_weights, context_kv=packed_kv
    )


def load_block_drafter(model_dir: Path | str, target: Model) -> BlockDraftModel:
    """Loads a block drafter for `target` in the target's dtype and on its device."""
    model_dir = Path(model_dir)
    config = load_block_drafter_config(model_dir)
    check_against_target(config, target.config)
    weights = load_block_weights(model_dir, config, target)
    return BlockDraftModel(
        config,
        weights,
        device=target.device,
        dtype=target.dtype,
        max_position=target.max_position + config.block_size,
    )
