"""Dense weights encoded into the released quantized layouts, each from its published description
(not from the loader's code), on whatever device the weight lies:
- GPTQ (AutoGPTQ): qweight int32 [K / 8, N], input 8 r + i in nibble i of row r; qzeros int32
  [G, N / 8], output 8 c + i in nibble i of word c, stored minus one in checkpoint_format
  'gptq' (as is in 'gptq_v2'); scales [G, N]; g_idx [K] (act-order: any grouping of inputs).
- AWQ (AutoAWQ GEMM): qweight int32 [K, N / 8] and qzeros [G, N / 8], output 8 c + order[i]
  in nibble i, order (0, 2, 4, 6, 1, 3, 5, 7); scales [G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, K / 8], input 8 c + i in nibble i,
  each value stored + 8; weight_scale [N, G]; an asymmetric weight_zero_point [N / 8, G] packed
  along outputs the same way; weight_shape [N, K].
- FP8: float8_e4m3fn weight with weight_scale (per tensor or per channel) or weight_scale_inv
  (per block of the config's weight_block_size, as Qwen3's FP8 release stores it).
Every encoder also returns the dense weight its tensors stand for. `quantized_model` builds a
layout's `Model` from a dense one through the loader's `load_weights` (HF-named state dict).
"""

from __future__ import annotations

import dataclasses

import torch

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, min_zero: int = 0):
    """Round-to-nearest 4-bit groups of inputs, groups of equal size: (q [N, K] 0..15,
    scale [N, G] (fp16-representable), zero [N, G])."""
    n, k = w.shape
    size = k // groups
    order = torch.argsort(g_idx, stable=True)  # inputs of group 0, then of group 1, ...
    if not torch.equal(g_idx[order], torch.arange(k, device=g_idx.device) // size):
        raise ValueError("rtn needs groups of equal size")
    x = w[:, order].reshape(n, groups, size)  # [N, G, size]
    if sym:
        s = x.abs().amax(2).clamp(min=1e-6) / 7.0
        z = torch.full((n, groups), 8, dtype=torch.int64, device=w.device)
    else:
        lo, hi = x.amin(2).clamp(max=0), x.amax(2).clamp(min=0)
        s = ((hi - lo) / 15.0).clamp(min=1e-6)
        z = torch.round(-lo / s).clamp(min_zero, 15).long()
    s = s.half().float()  # the checkpoints keep fp16 scales
    grouped = (torch.round(x / s[..., None]) + z[..., None]).clamp(0, 15).long()
    q = torch.empty((n, k), dtype=torch.int64, device=w.device)
    q[:, order] = grouped.reshape(n, k)
    return q, s, z


def dequant(q, scale, zero, g_idx) -> torch.Tensor:
    return (q - zero[:, g_idx]).float() * scale[:, g_idx]


def pack_along_last(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [..., 8 C] of 0..15 -> int32 [..., C], value 8 c + order[i] in nibble i."""
    q = q.reshape(*q.shape[:-1], -1, 8).long()
    packed = torch.zeros(q.shape[:-1], dtype=torch.int64, device=q.device)
    for i in range(8):
        packed |= (q[..., order[i]] & 0xF) << (4 * i)
    return (packed - (packed >= 2**31).long() * 2**32).to(torch.int32)  # as int32 bits


def group_index(k: int, group_size: int, act_order: bool, seed: int, device=None):
    """g_idx [K]: input k in group k // group_size, or (act-order) in a seeded permutation."""
    plain = torch.arange(k) // group_size
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        plain = plain[perm.argsort()]  # input perm[j] is the j-th quantized, group j // size
    return plain if device is None else plain.to(device)


def encode_int4(
    w: torch.Tensor,  # [N, K]
    fmt: str,
    g_idx: torch.Tensor,  # [K]
    groups: int,
    sym: bool = True,
    act_order: bool = False,
    gptq_format: str = "gptq",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({tensor suffix: tensor} of one linear layer in `fmt` ('gptq', 'awq',
    'pack-quantized'), the dense float32 weight it stands for)."""
    w = w.float()
    n, k = w.shape
    min_zero = 1 if fmt == "gptq" and gptq_format == "gptq" else 0  # v1 stores zero - 1
    q, scale, zero = rtn(w, g_idx, groups, sym, min_zero)
    out = {}
    if fmt == "gptq":
        offset = 1 if gptq_format == "gptq" else 0
        rows = q.t().reshape(k // 8, 8, n).transpose(1, 2)  # [K / 8, N, 8]
        out["qweight"] = pack_along_last(rows)[..., 0]
        out["qzeros"] = pack_along_last((zero - offset).t())
        out["scales"] = scale.t().half().contiguous()
        out["g_idx"] = g_idx.to(torch.int32)
    elif fmt == "awq":
        out["qweight"] = pack_along_last(q.t(), AWQ_ORDER)
        out["qzeros"] = pack_along_last(zero.t(), AWQ_ORDER)
        out["scales"] = scale.t().half().contiguous()
    else:
        out["weight_packed"] = pack_along_last(q)
        out["weight_scale"] = scale.half()
        out["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not sym:
            out["weight_zero_point"] = pack_along_last(zero.t()).t().contiguous()
        if act_order:
            out["weight_g_idx"] = g_idx.to(torch.int32)
    return out, dequant(q, scale, zero, g_idx)


def encode_fp8(
    w: torch.Tensor, strategy: str, block: tuple[int, int] = (128, 128)
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({tensor suffix: tensor} of one linear layer in FP8 with scales per 'tensor', 'channel'
    or 'block', the dense float32 weight it stands for: weight * scale)."""
    w = w.float()
    n, k = w.shape
    if strategy == "tensor":
        scale = full = w.abs().amax() / FP8_MAX
    elif strategy == "channel":
        scale = full = w.abs().amax(1, keepdim=True) / FP8_MAX  # [N, 1]
    else:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros((rows * bn, cols * bk), device=w.device)  # a ragged edge reads 0
        padded[:n, :k] = w.abs()
        scale = padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3)) / FP8_MAX  # [rows, cols]
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    name = "weight_scale_inv" if strategy == "block" else "weight_scale"
    out = {"weight": q, name: scale.float().reshape(() if strategy == "tensor" else scale.shape)}
    if strategy == "tensor":
        out["input_scale"] = torch.tensor(0.02)
    return out, q.float() * full


def int4_config(fmt: str, group_size: int, sym: bool, act_order: bool, gptq_format: str) -> dict:
    """The `quantization_config` of an int4 checkpoint in `fmt`."""
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "sym": sym,
            "desc_act": act_order,
            "checkpoint_format": gptq_format,
        }
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": not sym,
            "version": "gemm",
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": sym,
        "dynamic": False,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": "group" if act_order else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": ["lm_head"],
    }


def fp8_config(strategy: str, block: tuple[int, int] = (128, 128)) -> dict:
    """The `quantization_config` of an FP8 checkpoint: compressed-tensors for per-channel
    scales, the `fp8` method (static per-tensor, or Qwen3's dynamic block release) otherwise."""
    if strategy == "channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
            },
            "ignore": ["lm_head"],
        }
    if strategy == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


@dataclasses.dataclass(frozen=True)
class Layout:
    """A released layout to build: 'gptq' (int4, sym, no act-order, `group_size`) or 'fp8'
    (`fp8_block` scales)."""

    kind: str
    group_size: int = 128
    fp8_block: tuple[int, int] = (128, 128)

    def config(self) -> dict:
        if self.kind == "gptq":
            return int4_config("gptq", self.group_size, True, False, "gptq")
        return fp8_config("block", self.fp8_block)

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "gptq":
            k = w.shape[1]
            g_idx = group_index(k, self.group_size, False, 0, w.device)
            return encode_int4(w, "gptq", g_idx, k // self.group_size)[0]
        return encode_fp8(w, "block", self.fp8_block)[0]


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """A dense `Model`'s weights under Hugging Face names (q/k/v and gate/up split again):
    views of its tensors, no copies."""
    cfg, w = model.config, model.weights
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if w.lm_head is not w.embed:
        sd["lm_head.weight"] = w.lm_head
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = lw.qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = lw.gate_up.split([cfg.intermediate_size] * 2)
        parts = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v}
        parts |= {"self_attn.o_proj": lw.o_proj, "mlp.gate_proj": gate, "mlp.up_proj": up}
        parts["mlp.down_proj"] = lw.down
        sd |= {f"{p}{name}.weight": t for name, t in parts.items()}
        sd[p + "input_layernorm.weight"] = lw.input_norm
        sd[p + "post_attention_layernorm.weight"] = lw.post_norm
        if lw.q_norm is not None:
            sd[p + "self_attn.q_norm.weight"] = lw.q_norm
            sd[p + "self_attn.k_norm.weight"] = lw.k_norm
    return sd


def quantized_model(model, layout: Layout, ops_backend: str = "auto"):
    """A `Model` with `model`'s weights in `layout`: every linear layer of its layers encoded
    (the embedding and LM head stay dense, as the releases keep them), then read by the
    loader's `load_weights` under the layout's `quantization_config`. Hybrid targets are
    refused, as the loader refuses their quantized checkpoints."""
    from executor.loader import load_weights
    from executor.model import Model
    from executor.quant.scheme import quant_scheme

    if model.config.is_hybrid:
        raise ValueError("quantized_model takes dense-attention targets only")
    scheme = quant_scheme({"quantization_config": layout.config()})
    sd = hf_state_dict(model)
    for name in [n for n in sd if n.startswith("model.layers.") and n.endswith(".weight")]:
        prefix = name[: -len(".weight")]
        if prefix.split(".", 3)[3] in LINEARS:
            dense = sd.pop(name)
            sd |= {f"{prefix}.{suffix}": t for suffix, t in layout.encode(dense).items()}
    weights = load_weights(None, model.config, model.dtype, model.device, scheme, sd=sd)
    return Model(
        model.config,
        weights,
        device=model.device,
        dtype=model.dtype,
        ops_backend=ops_backend,
        max_position=model.max_position,
    )
