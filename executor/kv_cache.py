"""Paged KV cache tensors. Block *ids* are handed out by `scheduler.kv_blocks.BlockPool`; this
module only owns the memory: per KV layer `k, v [num_blocks, block_size, num_kv_heads, head_dim]`.
KV layers are the model's attention layers (`ModelConfig.kv_layer_ids`): a hybrid target's
linear-attention layers keep recurrent state instead and take no KV. The tensors hold the
model's dtype, or float8_e4m3fn (`--kv-cache-dtype fp8`: one byte per element, so a budget holds
twice the tokens of bf16; values scaled per KV head, `executor/kv_scales.py`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from executor.model_config import ModelConfig
from kernels.kv_fp8 import FP8_KV_DTYPE

if TYPE_CHECKING:
    from executor.model import Model

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r} (examples: 8GiB, 512MiB, 2000000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is fp8_e4m3, as vLLM names them


def fp8_kv_unsupported(device: torch.device) -> str | None:
    """Why an FP8 KV cache cannot run on `device`, or None where it can: the Triton kernels
    convert float8_e4m3fn natively on NVIDIA from compute capability 8.9 and on AMD; the CPU
    runs the torch references."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= (8, 9):
        return None
    name = torch.cuda.get_device_name(index)
    return (
        f"{name} is compute capability {major}.{minor} and the kernels' float8_e4m3fn needs "
        "8.9 or newer (Ada, Hopper, Blackwell): use --kv-cache-dtype auto"
    )


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype | None, device: torch.device
) -> torch.dtype | None:
    """The KV tensors' dtype for `--kv-cache-dtype name` ('auto': `model_dtype`); ValueError in
    one line for a value that is not one or a device where FP8 cannot run."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"--kv-cache-dtype must be one of {choices}, got {name!r}")
    reason = fp8_kv_unsupported(device)
    if reason is not None:
        raise ValueError(f"--kv-cache-dtype {name} cannot run on {device}: {reason}")
    return FP8_KV_DTYPE


def auto_kv_budget(device: torch.device, fraction: float = 0.85) -> int:
    """Bytes for the KV cache when the user gives none: a share of what the device has free
    after the weights are loaded (CPU: a fixed modest budget, tests and demos only)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return 256 * 1024**2


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per KV layer [num_blocks, block_size, num_kv_heads, head_dim]
    v: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        num = len(config.kv_layer_ids)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num)]
        return cls(k=k, v=v, num_blocks=num_blocks, block_size=block_size)

    @classmethod
    def for_model(cls, model: Model, *, num_blocks: int, block_size: int) -> KVCache:
        """A cache for `model`'s layers in its KV cache dtype, on its device."""
        return cls.allocate(
            model.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.kv_cache_dtype,
            device=model.device,
        )

    @staticmethod
    def blocks_for_budget(
        configs: list[ModelConfig], budget_bytes: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Blocks that fit the budget when every model in `configs` (target, draft) keeps one
        cache of `dtype` (the caches' element type, not the weights') indexed by the same block
        ids."""
        elt = torch.tensor([], dtype=dtype).element_size()
        per_block = sum(c.kv_bytes_per_token(elt) for c in configs) * block_size
        return max(budget_bytes // per_block, 0)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
