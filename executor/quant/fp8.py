"""FP8 (e4m3) linear layers: float8 weights [N, K] with float32 scales, per tensor ([] or
[1]), per output channel ([N] or [N, 1]) or per [bn, bk] block ([ceil(N / bn), ceil(K / bk)],
the `weight_scale_inv` of Qwen3's and DeepSeek's FP8 releases, a multiplier despite its name).

On a CPU the loader dequantizes every FP8 weight into the model's dtype (`dequantize_fp8`). On
a GPU an `Fp8Linear` keeps the weight in FP8 with one scale per output channel (a block-scaled
weight is requantized to per-channel scales at load, an approximation of the checkpoint: one
more FP8 rounding per weight). Products of 1-64 rows run the W8A16 skinny kernel of
`kernels/fp8_linear.py`, which streams the weight once and leaves the activations in their
dtype; more rows multiply through `torch._scaled_mm` (W8A8), each activation row scaled to FP8
at run time (its own absmax, `kernels.fp8_linear.quantize_rows`). Both paths are tested on the
H200 (tests/kernels/test_fp8_linear.py, tests/quant/test_gpu_quant.py) and measured there
(docs/perf/quant.md, docs/perf/quant-linear.md).
"""

from __future__ import annotations

import torch

from executor.model_config import ModelLoadError
from executor.quant.linear import QuantLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def expand_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None):
    """A weight scale of any of the three layouts as a float32 multiplier broadcastable to
    [N, K]."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1 and scale.shape[0] == n):
        if scale.numel() != n:
            raise ModelLoadError(f"fp8 weight [{n}, {k}]: scale of shape {tuple(scale.shape)}")
        return scale.reshape(n, 1)
    if block is None:
        raise ModelLoadError(
            f"fp8 weight [{n}, {k}]: a scale of shape {tuple(scale.shape)} needs the config's "
            "weight_block_size"
        )
    bn, bk = block
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ModelLoadError(
            f"fp8 weight [{n}, {k}]: block scale {tuple(scale.shape)} does not fit blocks {block}"
        )
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]


def dequantize_fp8(weight, scale, block, dtype) -> torch.Tensor:
    """float8 [N, K] and its scale -> [N, K] in `dtype`."""
    n, k = weight.shape
    return (weight.float() * expand_scale(scale, n, k, block)).to(dtype)


def per_channel(weight, scale, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [N, K], float32 [N]) with one scale per output channel: the checkpoint's own
    when it has at most that many, else the weight dequantized and scaled to FP8 again."""
    n, k = weight.shape
    if scale.numel() == 1 or scale.numel() == n:
        return weight, expand_scale(scale, n, k, block).expand(n, 1).reshape(n).contiguous()
    w = weight.float() * expand_scale(scale, n, k, block)  # [N, K]
    row = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)  # [N]
    return (w / row[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), row


def scaled_mm_linear(x, weight, weight_scale, bias=None) -> torch.Tensor:
    """x [M, K] @ (weight * weight_scale[:, None])^T: every row of x scaled to FP8 by its own
    absmax (dynamic per-token), then one `torch._scaled_mm` with row-wise scales, bf16 out
    (what its row-wise mode produces), cast to x's dtype. -> [M, N]"""
    from kernels import fp8_linear as k

    x = x if x.stride(-1) == 1 else x.contiguous()
    # one fused launch on a GPU; torch's ops elsewhere (the same values)
    xq, x_scale = (k.quantize_rows if x.is_cuda else k.quantize_rows_ref)(x)  # [M, K], [M, 1]
    out = torch._scaled_mm(
        xq,
        weight.t(),  # column-major [K, N], as the GEMM wants its second operand
        scale_a=x_scale,
        scale_b=weight_scale.reshape(1, -1),
        out_dtype=torch.bfloat16,
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


class Fp8Linear(QuantLinear):
    """float8 weight [N, K] with one float32 scale per output channel."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.weight = weight.contiguous()  # [N, K] float8_e4m3fn
        self.scale = scale.float().contiguous()  # [N]
        self.dtype = dtype
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x, bias=None, kernels=False):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if kernels and x.is_cuda:
            from kernels import fp8_linear as k

            if 1 <= x2.shape[0] <= k.SKINNY_MAX_ROWS:  # W8A16, the weight read once
                out = k.fp8_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.weight,
                                   self.scale, bias)  # fmt: skip
            else:
                out = scaled_mm_linear(x2, self.weight, self.scale, bias)
        else:
            out = torch.nn.functional.linear(x2, self.dequantize().to(x.dtype), bias)
        return out.reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(self.dtype)

    @staticmethod
    def cat(parts: list[Fp8Linear]) -> Fp8Linear:
        return Fp8Linear(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.scale for p in parts]),
            parts[0].dtype,
        )
