"""The scales of an FP8 KV cache: one float32 multiplier per (KV layer, KV head) for K and one for
V. The cache stores `value / scale` and attention reads `stored * scale` (`kernels.kv_fp8`).

A checkpoint calibrated for an FP8 KV cache carries them as `model.layers.N.self_attn.k_scale`
and `v_scale` (a scalar, which serves every head, or one per KV head); a layer without them
takes 1.0, as vLLM does. A cache in the model's own dtype never reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executor.model_config import ModelConfig, ModelLoadError


@dataclass(frozen=True)
class KVScales:
    k: tuple[torch.Tensor, ...]  # per KV layer (ModelConfig.kv_layer_ids) [num_kv_heads] fp32
    v: tuple[torch.Tensor, ...]
    num_from_checkpoint: int = 0  # KV layers whose scales the checkpoint gave
    per_head: bool = False  # some layer's checkpoint scales were per head

    @classmethod
    def ones(cls, config: ModelConfig, device: torch.device) -> KVScales:
        return cls._of(torch.ones(2, len(config.kv_layer_ids), config.num_kv_heads), device)

    @classmethod
    def _of(cls, table: torch.Tensor, device, **info) -> KVScales:
        """From a [2, num_kv_layers, num_kv_heads] table (K, then V): each layer's entry is a
        contiguous view of one device tensor."""
        table = table.to(device=device, dtype=torch.float32).contiguous()
        return cls(k=tuple(table[0].unbind(0)), v=tuple(table[1].unbind(0)), **info)

    def describe(self) -> str:
        """Where the scales came from, for the start-up log."""
        num = len(self.k)
        if self.num_from_checkpoint == 0:
            return "k/v scales 1.0 (the checkpoint has none)"
        kind = "per KV head" if self.per_head else "per layer"
        rest = "" if self.num_from_checkpoint == num else ", 1.0 for the others"
        found = f"{self.num_from_checkpoint}/{num}"
        return f"k/v scales from the checkpoint ({kind}) for {found} KV layers{rest}"


def _scale_values(t: torch.Tensor, name: str, num_kv_heads: int) -> torch.Tensor:
    """A checkpoint's scale tensor as [num_kv_heads] float32; ModelLoadError if unusable."""
    values = t.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    if values.numel() == 1:
        values = values.expand(num_kv_heads)
    elif values.numel() != num_kv_heads:
        raise ModelLoadError(
            f"{name} has shape {list(t.shape)}: expected a scalar or [{num_kv_heads}] "
            "(one scale per KV head)"
        )
    bad = [v for v in values.tolist() if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ModelLoadError(f"{name} holds {bad[0]}: KV scales must be finite and positive")
    return values


def take_kv_scales(
    sd: dict[str, torch.Tensor],
    config: ModelConfig,
    device: torch.device,
    prefix: str = "model.layers.",
) -> KVScales:
    """Pops every KV layer's `{prefix}N.self_attn.{k,v}_scale` from the state dict; absent
    ones are 1.0 (a layer with only one of the two keeps 1.0 for the other)."""
    table = torch.ones(2, len(config.kv_layer_ids), config.num_kv_heads)
    found, per_head = set(), False
    for j, layer in enumerate(config.kv_layer_ids):
        for side, kind in enumerate(("k", "v")):
            name = f"{prefix}{layer}.self_attn.{kind}_scale"
            t = sd.pop(name, None)
            if t is None:
                continue
            table[side, j] = _scale_values(t, name, config.num_kv_heads)
            per_head |= t.numel() > 1
            found.add(j)
    return KVScales._of(table, device, num_from_checkpoint=len(found), per_head=per_head)
