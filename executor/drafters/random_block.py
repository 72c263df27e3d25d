"""Random-weight block drafters of real shapes, built beside a random target on its device (the
benchmarks and the cost profiler without a checkpoint): `random-block:qwen3-8b-dflash` selects
one. Their drafts are noise; what they are for is the cost of a block drafter of that shape.

`qwen3-8b-dflash` has the shape of the released Qwen3-8B drafter (z-lab/Qwen3-8B-DFlash-b16):
5 Qwen3 decoder layers of the target's width (hidden 4096, intermediate 12288, 32 q heads,
8 kv heads, head_dim 128), blocks of 16, target layers (1, 9, 17, 25, 33) of its 36, mask token
151669 (Qwen3's first free id). docs/perf/block-drafting.md says where these numbers come from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from executor.drafters.block_config import BlockDrafterConfig, check_against_target
from executor.drafters.block_model import BlockDrafterWeights, BlockDraftModel
from executor.model import LayerWeights, Model, ModelWeights
from executor.random_model import PRESETS


@dataclass(frozen=True)
class BlockPreset:
    target: str  # the random target preset (executor/random_model.py) it is shaped for
    num_layers: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int


BLOCK_PRESETS: dict[str, BlockPreset] = {
    "qwen3-8b-dflash": BlockPreset(
        target="qwen3-8b",
        num_layers=5,
        intermediate_size=12288,
        target_layer_ids=(1, 9, 17, 25, 33),
        block_size=16,
        mask_token_id=151669,
    ),
    # The same layout at toy size beside `random:tiny`: CPU tests of the harnesses.
    "tiny-dflash": BlockPreset(
        target="tiny",
        num_layers=2,
        intermediate_size=128,
        target_layer_ids=(0, 1),
        block_size=8,
        mask_token_id=511,
    ),
}


def block_preset_config(name: str, target: Model) -> BlockDrafterConfig:
    """The drafter config of preset `name` beside `target`: the target preset's heads, norms
    and RoPE (Qwen3 decoder layers), the preset's depth and MLP width; ValueError (one line)
    for an unknown name or a target it cannot serve."""
    if name not in BLOCK_PRESETS:
        raise ValueError(
            f"unknown random block drafter {name!r} (choose {', '.join(BLOCK_PRESETS)})"
        )
    preset = BLOCK_PRESETS[name]
    decoder = dataclasses.replace(
        PRESETS[preset.target],
        arch="DFlashDraftModel",
        num_layers=preset.num_layers,
        intermediate_size=preset.intermediate_size,
        # a block reaches block_size - 1 positions past the target's last one
        max_position=target.max_position + preset.block_size,
        vocab_size=target.config.vocab_size,
        hidden_size=target.config.hidden_size,
    )
    config = BlockDrafterConfig(
        decoder=decoder,
        target_layer_ids=preset.target_layer_ids,
        block_size=preset.block_size,
        mask_token_id=preset.mask_token_id,
        num_target_layers=PRESETS[preset.target].num_layers,
    )
    try:
        check_against_target(config, target.config)
    except ValueError as e:
        raise ValueError(f"random block drafter {name!r} does not fit the target: {e}") from None
    return config


def random_block_drafter(target: Model, name: str, seed: int = 0) -> BlockDraftModel:
    """A block drafter of preset `name` with random weights beside `target` (its device and
    dtype; the target's embedding and lm_head shared by reference, as a loaded one's are)."""
    config = block_preset_config(name, target)
    dec = config.decoder
    device, dtype = target.device, target.dtype
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        # std 1/sqrt(fan_in), as random_model's: activations stay O(1) through the layers
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
        return (t * shape[-1] ** -0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, i, q, kv = dec.hidden_size, dec.intermediate_size, dec.q_size, dec.kv_size
    layers = tuple(
        LayerWeights(
            input_norm=ones(h),
            qkv=w(q + 2 * kv, h),
            qkv_bias=None,
            q_norm=ones(dec.head_dim),
            k_norm=ones(dec.head_dim),
            o_proj=w(h, q),
            post_norm=ones(h),
            gate_up=w(2 * i, h),
            down=w(h, i),
        )
        for _ in range(dec.num_layers)
    )
    weights = BlockDrafterWeights(
        fc=w(h, len(config.target_layer_ids) * h),
        hidden_norm=ones(h),
        decoder=ModelWeights(
            embed=target.weights.embed,
            layers=layers,
            final_norm=ones(h),
            lm_head=target.weights.lm_head,
        ),
    )
    return BlockDraftModel(
        config, weights, device=device, dtype=dtype, max_position=dec.max_position
    )
