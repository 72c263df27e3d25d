"""Tiny quantized HF checkpoints written offline from a tiny dense one, each format packed from
its published description (not from the loader's code):
- GPTQ (AutoGPTQ): qweight int32 [K / 8, N], input 8 r + i in nibble i of row r; qzeros int32
  [G, N / 8], output 8 c + i in nibble i of word c, stored minus one in checkpoint_format
  'gptq' (as is in 'gptq_v2'); scales [G, N]; g_idx [K] (act-order: any grouping of inputs).
- AWQ (AutoAWQ GEMM): qweight int32 [K, N / 8] and qzeros [G, N / 8], output 8 c + order[i]
  in nibble i, order (0, 2, 4, 6, 1, 3, 5, 7); scales [G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, K / 8], input 8 c + i in nibble i,
  each value stored + 8; weight_scale [N, G]; an asymmetric weight_zero_point [N / 8, G] packed
  along outputs the same way; weight_shape [N, K].
- FP8: float8_e4m3fn weight with weight_scale (per tensor or per channel) or weight_scale_inv
  (per block of the config's weight_block_size).
Every writer returns the dense weights its checkpoint stands for (the format's dequantization
formula applied here), which `write_dense_copy` saves as the reference checkpoint.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, min_zero: int = 0):
    """Round-to-nearest 4-bit groups of inputs: (q [N, K] 0..15, scale [N, G], zero [N, G])."""
    n = w.shape[0]
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups, dtype=torch.int64)
    q = torch.empty(w.shape, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        x = w[:, cols]
        if sym:
            s = x.abs().amax(1).clamp(min=1e-6) / 7.0
            z = torch.full((n,), 8)
        else:
            lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
            s = ((hi - lo) / 15.0).clamp(min=1e-6)
            z = torch.round(-lo / s).clamp(min_zero, 15).long()
        s = s.half().float()  # the checkpoints keep fp16 scales
        q[:, cols] = (torch.round(x / s[:, None]) + z[:, None]).clamp(0, 15).long()
        scale[:, g], zero[:, g] = s, z
    return q, scale, zero


def dequant(q, scale, zero, g_idx) -> torch.Tensor:
    return (q - zero[:, g_idx]).float() * scale[:, g_idx]


def pack_along_last(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [..., 8 C] of 0..15 -> int32 [..., C], value 8 c + order[i] in nibble i."""
    q = q.reshape(*q.shape[:-1], -1, 8).long()
    packed = torch.zeros(q.shape[:-1], dtype=torch.int64)
    for i in range(8):
        packed |= (q[..., order[i]] & 0xF) << (4 * i)
    return (packed - (packed >= 2**31).long() * 2**32).to(torch.int32)  # as int32 bits


def _layers(sd: dict):
    for name in list(sd):
        if name.startswith("model.layers.") and name.endswith(".weight"):
            prefix = name[: -len(".weight")]
            if prefix.split(".", 3)[3] in LINEARS:
                yield prefix


def _group_index(k: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    plain = torch.arange(k) // group_size
    if not act_order:
        return plain
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    return plain[perm.argsort()]  # input perm[j] is the j-th quantized, group j // size


def _input_of(prefix: str) -> str:
    """Layers reading the same input (q/k/v, gate/up) share it: act-order gives them one order,
    as their inputs' statistics are the same."""
    layer, name = prefix.rsplit(".", 2)[0], prefix.rsplit(".", 1)[1]
    return layer + {"k_proj": ".q_proj", "v_proj": ".q_proj", "up_proj": ".gate_proj"}.get(
        name, "." + name
    )


def write_int4(
    src: Path,
    dst: Path,
    fmt: str,
    group_size: int,
    sym: bool = True,
    act_order: bool = False,
    gptq_format: str = "gptq",
    shared_order: bool = True,
) -> dict:
    """Writes `src` quantized as `fmt` ('gptq', 'awq', 'pack-quantized') into `dst`; returns the
    dense state dict it stands for. `shared_order=False` gives every layer its own act-order."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    dense, out = dict(sd), {n: t for n, t in sd.items()}
    for prefix in _layers(sd):
        w = out.pop(prefix + ".weight").float()  # [N, K]
        n, k = w.shape
        size = k if group_size == -1 else group_size
        seed = zlib.crc32((_input_of(prefix) if shared_order else prefix).encode())
        g_idx = _group_index(k, size, act_order, seed=seed)
        min_zero = 1 if fmt == "gptq" and gptq_format == "gptq" else 0  # v1 stores zero - 1
        q, scale, zero = rtn(w, g_idx, k // size, sym, min_zero)
        dense[prefix + ".weight"] = dequant(q, scale, zero, g_idx)
        if fmt == "gptq":
            offset = 1 if gptq_format == "gptq" else 0
            rows = q.t().reshape(k // 8, 8, n).transpose(1, 2)  # [K / 8, N, 8]
            out[prefix + ".qweight"] = pack_along_last(rows)[..., 0]
            out[prefix + ".qzeros"] = pack_along_last((zero - offset).t())
            out[prefix + ".scales"] = scale.t().half().contiguous()
            out[prefix + ".g_idx"] = g_idx.to(torch.int32)
        elif fmt == "awq":
            out[prefix + ".qweight"] = pack_along_last(q.t(), AWQ_ORDER)
            out[prefix + ".qzeros"] = pack_along_last(zero.t(), AWQ_ORDER)
            out[prefix + ".scales"] = scale.t().half().contiguous()
        else:
            out[prefix + ".weight_packed"] = pack_along_last(q)
            out[prefix + ".weight_scale"] = scale.half()
            out[prefix + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not sym:
                out[prefix + ".weight_zero_point"] = pack_along_last(zero.t()).t().contiguous()
            if act_order:
                out[prefix + ".weight_g_idx"] = g_idx.to(torch.int32)
    save_file({n: t.contiguous() for n, t in out.items()}, str(dst / "model.safetensors"))
    _set_quant_config(dst, _int4_config(fmt, group_size, sym, act_order, gptq_format))
    return dense


def _int4_config(fmt, group_size, sym, act_order, gptq_format) -> dict:
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


def _set_quant_config(dst: Path, quant: dict) -> None:
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))


def write_fp8(src: Path, dst: Path, strategy: str, block: tuple[int, int] = (128, 128)) -> dict:
    """Writes `src` with FP8 linear layers, scales per 'tensor', 'channel' or 'block'; returns
    the dense state dict it stands for (weight * scale)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    dense, out = dict(sd), dict(sd)
    for prefix in _layers(sd):
        w = out.pop(prefix + ".weight").float()
        n, k = w.shape
        if strategy == "tensor":
            scale = w.abs().amax() / 448.0
            full = scale
        elif strategy == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448.0  # [N, 1]
            full = scale
        else:
            bn, bk = block
            rows, cols = -(-n // bn), -(-k // bk)
            scale = torch.empty(rows, cols)
            for r in range(rows):
                for c in range(cols):
                    scale[r, c] = w[r * bn : (r + 1) * bn, c * bk : (c + 1) * bk].abs().amax() / 448
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        dense[prefix + ".weight"] = q.float() * full
        out[prefix + ".weight"] = q
        name = ".weight_scale_inv" if strategy == "block" else ".weight_scale"
        out[prefix + name] = scale.float().reshape(() if strategy == "tensor" else scale.shape)
        if strategy == "tensor":
            out[prefix + ".input_scale"] = torch.tensor(0.02)
    save_file({n: t.contiguous() for n, t in out.items()}, str(dst / "model.safetensors"))
    if strategy == "channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
            },
            "ignore": ["lm_head"],
        }
    elif strategy == "tensor":
        quant = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        quant = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    _set_quant_config(dst, quant)
    return dense


def write_dense_copy(src: Path, weights: dict, dst: Path) -> Path:
    """`src` with its safetensors replaced by `weights` (float32) and no quantization_config."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(
        {n: t.float().contiguous() for n, t in weights.items()}, str(dst / "model.safetensors")
    )
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst
