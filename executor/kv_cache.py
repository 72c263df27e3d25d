"""Paged KV cache tensors. Block *ids* are handed out by `scheduler.kv_blocks.BlockPool`; this
module only owns the memory: per KV layer `k, v [num_blocks, block_size, num_kv_heads, head_dim]`.
KV layers are the model's attention layers (`ModelConfig.kv_layer_ids`): a hybrid target's
linear-attention layers keep recurrent state instead and take no KV."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from executor.model_config import ModelConfig

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
        """A cache for `model`'s layers in its dtype, on its device."""
        return cls.allocate(
            model.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
        )

    @staticmethod
    def blocks_for_budget(
        configs: list[ModelConfig], budget_bytes: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Blocks that fit the budget when every model in `configs` (target, draft) keeps one
        cache indexed by the same block ids."""
        elt = torch.tensor([], dtype=dtype).element_size()
        per_block = sum(c.kv_bytes_per_token(elt) for c in configs) * block_size
        return max(budget_bytes // per_block, 0)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
