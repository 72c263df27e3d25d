"""Random-weight models of any config for kernel-path tests. Unlike `executor.random_model`
(norm weights of one), every norm weight is random too, so a kernel that applies a weight lane
to the wrong element changes the logits."""

from __future__ import annotations

import torch

from executor.model import LayerWeights, Model, ModelWeights
from executor.model_config import ModelConfig


def random_norms_model(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, *, max_position: int, seed: int = 3
) -> Model:
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int, std: float | None = None) -> torch.Tensor:
        # std 1/sqrt(fan_in) keeps activations O(1) through the layers
        t = torch.randn(*shape, generator=gen, device=device)
        return (t * (std if std is not None else shape[-1] ** -0.5)).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.3 * torch.randn(n, generator=gen, device=device)).to(dtype)

    h, i, q, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    layers = tuple(
        LayerWeights(
            input_norm=norm(h),
            qkv=w(q + 2 * kv, h),
            qkv_bias=w(q + 2 * kv, std=0.1) if cfg.qkv_bias else None,
            q_norm=norm(d) if cfg.qk_norm else None,
            k_norm=norm(d) if cfg.qk_norm else None,
            o_proj=w(h, q),
            post_norm=norm(h),
            gate_up=w(2 * i, h),
            down=w(h, i),
        )
        for _ in range(cfg.num_layers)
    )
    weights = ModelWeights(
        embed=w(cfg.vocab_size, h, std=1.0),
        layers=layers,
        final_norm=norm(h),
        lm_head=w(cfg.vocab_size, h),
    )
    return Model(
        cfg, weights, device=device, dtype=dtype, ops_backend="torch", max_position=max_position
    )
