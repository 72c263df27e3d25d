"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3, and the hybrid Qwen3.5) over a
ragged batch of rows.

One call runs every new row of a round: prefill chunks, single AR rows and multi-row speculative
groups alike. A sequence contributes `q_len >= 1` consecutive rows; they attend causally among
themselves and to the sequence's cached KV. New K/V are written into the paged cache in place, so
after the forward the cache holds every row's KV (rejected speculative rows simply lie past the
committed end). A hybrid target's linear-attention layers read and write per-slot recurrent
state instead (`executor/linear_attention.py`, `executor/recurrent_state.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.hidden_capture import HiddenCapture
from executor.kv_scales import KVScales
from executor.linear_attention import LinearAttnWeights, linear_attention
from executor.model_config import ModelConfig
from executor.ops import select_ops, skinny_linear_enabled
from executor.quant.linear import QuantLinear, is_quantized, quant_linear, weight_nbytes
from executor.recurrent_state import RoundStates
from executor.rope import build_cos_sin_cache


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # [q_size + 2 * kv_size (+ q_size: the output gate, with attn_output_gate), hidden];
    # None (and o_proj too) on a linear-attention layer
    qkv: torch.Tensor | None
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim]
    o_proj: torch.Tensor | None  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    linear_attn: LinearAttnWeights | None = None  # a hybrid target's linear-attention layer


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)
    kv_scales: KVScales | None = None  # the checkpoint's FP8 KV cache scales; None: all 1.0


@dataclass(frozen=True)
class AttnMetadata:
    """Where the rows of one forward sit. Padded rows have slot -1 and belong to no sequence."""

    positions: torch.Tensor  # [num_rows] int64
    slot_mapping: torch.Tensor  # [num_rows] int64: block_id * block_size + offset, -1 = skip
    cu_q_lens: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length after this forward (new rows included)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    # Host-side bound on rows per sequence (spec depth of a decode round); sizes the attention
    # tile so a speculative group is one tile (KV read once). None: the kernel's own guess.
    max_q_len: int | None = None


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        *,
        device: torch.device,
        dtype: torch.dtype,
        ops_backend: str = "auto",
        max_position: int | None = None,
    ):
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.ops = select_ops(device, ops_backend)
        self.route_linear_through_ops = skinny_linear_enabled()
        self.quantized = is_quantized(weights)  # some linear weights are QuantLinear
        self.max_position = max_position or config.max_position
        self.cos_sin = build_cos_sin_cache(
            config.rope, config.head_dim, self.max_position, device
        )  # [max_position, rot_dim]
        self.scale = config.head_dim**-0.5
        # layer -> its entry in the KV cache's lists (linear-attention layers have none)
        self.kv_index = {layer: j for j, layer in enumerate(config.kv_layer_ids)}
        # The KV caches made for this model hold this dtype (the engine may set float8_e4m3fn);
        # an FP8 cache is read and written with the scales, which other caches ignore.
        self.kv_cache_dtype = dtype
        self.kv_scales = weights.kv_scales or KVScales.ones(config, device)

    def _weight_tensors(self) -> list[torch.Tensor | QuantLinear]:
        w = self.weights
        tensors = [w.embed, w.final_norm] + ([] if w.lm_head is w.embed else [w.lm_head])
        for lw in w.layers:
            parts = vars(lw) | (vars(lw.linear_attn) if lw.linear_attn is not None else {})
            tensors += [t for t in parts.values() if isinstance(t, torch.Tensor | QuantLinear)]
        return tensors

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self._weight_tensors())

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold on the device: packed linear layers (scales and zeros
        included) at their packed size, so a quantized model counts what it keeps."""
        return sum(weight_nbytes(t) for t in self._weight_tensors())

    @property
    def is_hybrid(self) -> bool:
        """Whether linear-attention layers keep per-slot recurrent state (`forward(states=)`)."""
        return self.config.is_hybrid

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_rows] int64
        meta: AttnMetadata,
        k_caches: list[torch.Tensor],  # per KV layer (config.kv_layer_ids) [blocks, page, Hkv, D]
        v_caches: list[torch.Tensor],
        capture: HiddenCapture | None = None,
        causal: bool = True,
        states: RoundStates | None = None,
    ) -> torch.Tensor:
        """Returns the final-normed hidden states [num_rows, hidden]. With `capture`, also
        writes the outputs of its layers into the first num_rows rows of its buffer. With
        `causal=False` every row attends to its whole sequence (a block drafter's block). A
        hybrid target needs `states`: where each sequence's recurrent state lives this round."""
        cfg, ops = self.config, self.ops
        if cfg.is_hybrid and states is None:
            raise ValueError("a hybrid target's forward needs its round's recurrent states")
        num_linear = 0
        linear = self._linear()
        num_rows = input_ids.shape[0]
        if capture is not None:
            capture.check_fits(cfg.num_layers, cfg.hidden_size, num_rows, self.dtype)
        hidden = self.weights.embed[input_ids]  # [num_rows, hidden]
        # what every layer's RoPE, K/V store and attention share, where the op set plans it
        plan = {}
        if ops.forward_plan is not None:
            plan["plan"] = ops.forward_plan(
                meta.positions, meta.slot_mapping, self.cos_sin, meta, causal
            )
        residual = None
        for i, lw in enumerate(self.weights.layers):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, lw.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.rms_norm(hidden, lw.input_norm, cfg.rms_norm_eps, residual)
                # Layer i-1 ends with its MLP output in `hidden`, not yet added to the stream:
                # the add is fused into this norm, whose second result is the residual stream
                # after layer i-1 (its output). `x` is normed and `hidden` lacks the stream.
                if capture is not None:
                    capture.store(i - 1, residual)
            if lw.linear_attn is not None:
                hidden = linear_attention(
                    x, lw.linear_attn, cfg.linear_attn, cfg.rms_norm_eps, states, num_linear, linear
                )
                num_linear += 1
                x, residual = ops.rms_norm(hidden, lw.post_norm, cfg.rms_norm_eps, residual)
                hidden = linear(ops.silu_and_mul(linear(x, lw.gate_up)), lw.down)
                continue
            kv = self.kv_index[i]
            qkv = linear(x, lw.qkv, lw.qkv_bias)  # [num_rows, q + 2 kv (+ q gate)]
            gate = None
            if cfg.attn_output_gate:  # the gate's columns follow v: qkv is read in place
                gate = qkv[:, cfg.q_size + 2 * cfg.kv_size :]  # [num_rows, q_size]
                qkv = qkv[:, : cfg.q_size + 2 * cfg.kv_size]
            # q/k head norm (Qwen3), RoPE and the K/V store read qkv in place in one pass.
            q = ops.qk_norm_rope_and_write_kv(
                qkv,
                lw.q_norm,
                lw.k_norm,
                cfg.rms_norm_eps,
                meta.positions,
                self.cos_sin,
                meta.slot_mapping,
                k_caches[kv],
                v_caches[kv],
                num_q_heads=cfg.num_q_heads,
                is_neox=True,  # every supported architecture rotates halves (HF rotate_half)
                k_scale=self.kv_scales.k[kv],
                v_scale=self.kv_scales.v[kv],
                **plan,
            )  # [num_rows, num_q_heads, head_dim]
            attn = ops.verify_attention(
                q,
                k_caches[kv],
                v_caches[kv],
                meta.cu_q_lens,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                max_q_len=meta.max_q_len,
                causal=causal,
                k_scale=self.kv_scales.k[kv],
                v_scale=self.kv_scales.v[kv],
                **plan,
            )  # [num_rows, num_q_heads, head_dim]
            attn = attn.reshape(num_rows, cfg.q_size)
            if gate is not None:
                attn = attn * torch.sigmoid(gate)
            hidden = linear(attn, lw.o_proj)
            x, residual = ops.rms_norm(hidden, lw.post_norm, cfg.rms_norm_eps, residual)
            hidden = linear(ops.silu_and_mul(linear(x, lw.gate_up)), lw.down)
        out, _ = ops.rms_norm(hidden, self.weights.final_norm, cfg.rms_norm_eps, residual)
        if capture is not None:
            # HF reports the last layer's output after the final norm (`hidden_states[-1]` is
            # `last_hidden_state`), and drafters are trained on HF's tensors: capture `out`,
            # not the stream the final norm's add returns.
            capture.store(cfg.num_layers - 1, out)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32."""
        return self._linear()(hidden, self.weights.lm_head).float()

    def _linear(self):
        """The linear layers' GEMM: the op set's (skinny kernel where it measured faster) when
        routed through it, else torch's F.linear; a quantized weight (a QuantLinear in place of
        a dense one, executor/quant) computes its own product."""
        dense = self.ops.linear if self.route_linear_through_ops else torch.nn.functional.linear
        if not self.quantized:
            return dense
        # the Triton op set is the one whose linear is not torch's own
        return quant_linear(dense, kernels=self.ops.kernels)
