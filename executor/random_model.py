"""Random-weight models of real shapes, built directly on the device (benchmarks and the cost
profiler on machines without checkpoints). `--model random:qwen3-8b` selects one."""

from __future__ import annotations

import torch

from executor.model import LayerWeights, Model, ModelWeights
from executor.model_config import ModelConfig, RopeConfig


def _qwen3(**shape) -> ModelConfig:
    """A Qwen3-architecture config: Qwen3's own vocabulary, head size, norms and RoPE base
    unless `shape` says otherwise."""
    defaults = dict(
        arch="Qwen3ForCausalLM",
        vocab_size=151936,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position=40960,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=True,
        rope=RopeConfig(theta=1000000.0),
        torch_dtype="bfloat16",
        eos_token_ids=(151645,),
    )
    return ModelConfig(**{**defaults, **shape})


PRESETS: dict[str, ModelConfig] = {
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_layers=36, num_q_heads=32),
    "qwen3-0.6b": _qwen3(
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_q_heads=16,
        tie_word_embeddings=True,
    ),
    # Same architecture at toy size: CPU tests of the benchmark harnesses.
    "tiny": _qwen3(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=4096,
        rope=RopeConfig(theta=10000.0),
        torch_dtype="float32",
        eos_token_ids=(0,),
    ),
}


def random_model(
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    ops_backend: str = "auto",
    max_position: int | None = None,
) -> Model:
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r} (choose {', '.join(PRESETS)})")
    cfg = PRESETS[name]
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int, std: float | None = None) -> torch.Tensor:
        # std 1/sqrt(fan_in) keeps activations O(1) through the layers, so logits and argmax
        # behave like a trained model's numerically (no inf/nan, no constant argmax).
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
        return (t * (std if std is not None else shape[-1] ** -0.5)).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    layers = tuple(
        LayerWeights(
            input_norm=ones(h),
            qkv=w(q + 2 * kv, h),
            qkv_bias=None,
            q_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
            k_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
            o_proj=w(h, q),
            post_norm=ones(h),
            gate_up=w(2 * i, h),
            down=w(h, i),
        )
        for _ in range(cfg.num_layers)
    )
    embed = w(cfg.vocab_size, h, std=1.0)
    lm_head = embed if cfg.tie_word_embeddings else w(cfg.vocab_size, h)
    weights = ModelWeights(embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)
    return Model(
        cfg, weights, device=device, dtype=dtype, ops_backend=ops_backend, max_position=max_position
    )
