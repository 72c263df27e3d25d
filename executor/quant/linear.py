"""The linear-layer interface of quantized weights: a `QuantLinear` stands where the model keeps a
dense [N, K] weight and is called as `weight(x, bias, kernels)`; `quant_linear` wraps the model's
dense GEMM so that one call site serves both kinds."""

from __future__ import annotations

from collections.abc import Callable

import torch


class QuantLinear:
    """A weight [out_features, in_features] held in a packed form. Subclasses compute
    `x @ W^T + bias` from it, through kernels on a GPU (`kernels=True`) or a torch reference."""

    out_features: int
    in_features: int

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, kernels: bool = False
    ) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight as a dense [N, K] tensor in the model's dtype."""
        raise NotImplementedError

    def numel(self) -> int:
        """Elements of the weight it stands for (what `Model.num_params` counts)."""
        return self.out_features * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes the packed form holds on the device (weights, scales, zeros, indices)."""
        tensors = (t for t in vars(self).values() if isinstance(t, torch.Tensor))
        return sum(t.numel() * t.element_size() for t in tensors)


def weight_nbytes(weight: torch.Tensor | QuantLinear) -> int:
    """Device bytes of a dense tensor or of a QuantLinear's packed form."""
    if isinstance(weight, QuantLinear):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def is_quantized(weights) -> bool:
    """Whether any linear layer of a `ModelWeights` is a `QuantLinear`."""
    return any(
        isinstance(w, QuantLinear) for lw in weights.layers for w in vars(lw).values()
    ) or isinstance(weights.lm_head, QuantLinear)


def quant_linear(dense: Callable, kernels: bool) -> Callable:
    """`dense` (F.linear's signature) for tensors, the weight's own product for a QuantLinear;
    `kernels`: the model runs Triton kernels (a GPU with the Triton op set)."""

    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantLinear):
            return weight(x, bias, kernels)
        return dense(x, weight, bias)

    return linear
