"""A linear layer's weight taken from a state dict by the tensors it has: `<prefix>.weight` (dense
or float8 with a scale), `<prefix>.qweight` (GPTQ / AWQ) or `<prefix>.weight_packed`
(compressed-tensors). Modules a checkpoint leaves unquantized thus load dense whatever its
scheme. Layers fused by the model (q/k/v, gate/up) are concatenated along their outputs in the
packed form; a fused set that mixes dense and quantized parts is dequantized into one tensor.
"""

from __future__ import annotations

import torch

from executor.model_config import ModelLoadError
from executor.quant import fp8, int4
from executor.quant.linear import QuantLinear
from executor.quant.scheme import QuantScheme


def _pop(sd: dict, name: str, device) -> torch.Tensor:
    try:
        return sd.pop(name).to(device)
    except KeyError:
        raise ModelLoadError(f"checkpoint lacks weight {name!r}") from None


def _pop_optional(sd: dict, name: str, device) -> torch.Tensor | None:
    t = sd.pop(name, None)
    return None if t is None else t.to(device)


def _method_check(scheme: QuantScheme | None, found: str, prefix: str, allowed: tuple[str, ...]):
    if scheme is None or scheme.method not in allowed:
        method = scheme.method if scheme else "none"
        raise ModelLoadError(
            f"{prefix}: the checkpoint holds {found} tensors but its quantization_config says "
            f"{method!r}"
        )


def take_one(sd: dict, prefix: str, scheme: QuantScheme | None, dtype, device):
    """The weight of one linear layer: a dense [N, K] tensor in `dtype`, or a QuantLinear (an
    FP8 weight on a CPU is dequantized here)."""
    if f"{prefix}.qweight" in sd:
        _method_check(scheme, "qweight", prefix, ("gptq", "awq"))
        qweight = _pop(sd, f"{prefix}.qweight", device)
        qzeros = _pop(sd, f"{prefix}.qzeros", device)
        scales = _pop(sd, f"{prefix}.scales", device)
        g_idx = _pop_optional(sd, f"{prefix}.g_idx", device)
        if scheme.method == "awq":
            return int4.from_awq(qweight, qzeros, scales, dtype)
        return int4.from_gptq(qweight, qzeros, scales, g_idx, scheme.zero_offset, dtype)
    if f"{prefix}.weight_packed" in sd:
        _method_check(scheme, "weight_packed", prefix, ("int4-pack",))
        packed = _pop(sd, f"{prefix}.weight_packed", device)
        scale = _pop(sd, f"{prefix}.weight_scale", device)
        zero_point = _pop_optional(sd, f"{prefix}.weight_zero_point", device)
        g_idx = _pop_optional(sd, f"{prefix}.weight_g_idx", device)
        shape = sd.pop(f"{prefix}.weight_shape", None)
        if shape is not None and tuple(int(s) for s in shape) != (
            scale.shape[0],
            packed.shape[1] * 8,
        ):
            raise ModelLoadError(
                f"{prefix}: weight_shape {shape.tolist()} does not match the packed tensors "
                "(inputs must be a multiple of 8)"
            )
        return int4.from_pack_quantized(
            packed, scale, zero_point if not scheme.sym else None, g_idx, dtype
        )
    weight = _pop(sd, f"{prefix}.weight", device)
    if weight.dtype != fp8.FP8:
        if weight.dtype in (torch.float8_e5m2, torch.int8, torch.int32, torch.uint8):
            raise ModelLoadError(f"{prefix}.weight is {weight.dtype}, which no scheme here reads")
        return weight.to(dtype).contiguous()
    _method_check(scheme, "float8", prefix, ("fp8",))
    scale = _pop_optional(sd, f"{prefix}.weight_scale_inv", device)
    if scale is None:
        scale = _pop(sd, f"{prefix}.weight_scale", device)
    sd.pop(f"{prefix}.input_scale", None)  # activations are scaled per token at run time
    if device.type != "cuda":
        return fp8.dequantize_fp8(weight, scale, scheme.weight_block, dtype)
    return fp8.Fp8Linear(*fp8.per_channel(weight, scale, scheme.weight_block), dtype)


def take_linear(sd: dict, prefixes: list[str], scheme: QuantScheme | None, dtype, device):
    """The weights of `prefixes` (one layer, or layers fused along their outputs) as one dense
    [sum N, K] tensor or one QuantLinear."""
    return fuse_linears([take_one(sd, p, scheme, dtype, device) for p in prefixes])


def fuse_linears(parts: list):
    """Linear weights that read one input (dense tensors or QuantLinears, as `take_one`
    returns them) as one weight of their outputs side by side."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if len({type(p) for p in parts}) == 1:
        return parts[0].cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, QuantLinear) else p for p in parts])


def linear_shape(weight) -> tuple[int, int]:
    """(out_features, in_features) of a dense [N, K] weight or a QuantLinear."""
    if isinstance(weight, QuantLinear):
        return weight.out_features, weight.in_features
    return tuple(weight.shape)
