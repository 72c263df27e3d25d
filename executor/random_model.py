"""Random-weight models of real shapes, built directly on the device (benchmarks and the cost
profiler on machines without checkpoints). `--model random:qwen3-8b` selects one; the hybrid
`random:qwen3.5-27b` has Qwen3.5's Gated DeltaNet layers beside its gated full attention."""

from __future__ import annotations

import dataclasses
import math

import torch

from executor.linear_attention import LinearAttnWeights
from executor.model import LayerWeights, Model, ModelWeights
from executor.model_config import LinearAttnConfig, ModelConfig, RopeConfig


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


def _qwen3_5(*, interval: int = 4, linear: LinearAttnConfig, **shape) -> ModelConfig:
    """A Qwen3.5 dense (hybrid) config as `executor.model_config.hybrid_config` reads one: every
    `interval`-th layer full attention with a sigmoid output gate, the others Gated DeltaNet;
    a quarter of each head rotated, zero-centred norms (folded at load, ones here)."""
    defaults = dict(
        arch="Qwen3_5ForCausalLM",
        vocab_size=248320,
        rope=RopeConfig(theta=10000000.0, rotary_dim=shape["head_dim"] // 4),
        eos_token_ids=(248044,),
    )
    cfg = _qwen3(**{**defaults, **shape})
    types = tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(cfg.num_layers)
    )
    return dataclasses.replace(cfg, layer_types=types, linear_attn=linear, attn_output_gate=True)


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
    # Qwen3.5-27B's text model, from its released config.json (text_config): hidden_size 5120,
    # num_hidden_layers 64, full_attention_interval 4 (layer_types: 48 linear_attention, 16
    # full_attention), num_attention_heads 24, num_key_value_heads 4, head_dim 256,
    # intermediate_size 17408, linear_num_key_heads 16, linear_num_value_heads 48,
    # linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4, vocab_size
    # 248320, rope_theta 1e7, partial_rotary_factor 0.25, max_position_embeddings 262144,
    # untied embeddings. 26.9 B text parameters: 53.8 GB in bf16, which leaves an H200's
    # 141 GB room for KV (64 KiB per token: only the 16 full layers keep it) and the recurrent
    # state (154 MB per slot). The largest dense Qwen3.5 released.
    "qwen3.5-27b": _qwen3_5(
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=64,
        num_q_heads=24,
        num_kv_heads=4,
        head_dim=256,
        max_position=262144,
        linear=LinearAttnConfig(
            num_key_heads=16,
            num_value_heads=48,
            key_head_dim=128,
            value_head_dim=128,
            conv_kernel=4,
        ),
    ),
    # The same architecture at toy size: CPU tests.
    "tiny-qwen3.5": _qwen3_5(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=4096,
        torch_dtype="float32",
        eos_token_ids=(0,),
        linear=LinearAttnConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8, conv_kernel=4
        ),
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
    gate = q if cfg.attn_output_gate else 0  # the output gate's columns follow q | k | v

    def layer(kind: str) -> LayerWeights:
        # attention's weights drawn before the MLP's: the dense presets keep their weights
        if kind == "linear_attention":
            la = _linear_attn(cfg, w, ones, device)
            attn = dict(qkv=None, qkv_bias=None, q_norm=None, k_norm=None, o_proj=None)
            attn["linear_attn"] = la
        else:
            attn = dict(
                qkv=w(q + 2 * kv + gate, h),
                qkv_bias=None,
                q_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
                k_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
                o_proj=w(h, q),
            )
        return LayerWeights(
            input_norm=ones(h), **attn, post_norm=ones(h), gate_up=w(2 * i, h), down=w(h, i)
        )

    kinds = cfg.layer_types or ("full_attention",) * cfg.num_layers
    layers = tuple(layer(kind) for kind in kinds)
    embed = w(cfg.vocab_size, h, std=1.0)
    lm_head = embed if cfg.tie_word_embeddings else w(cfg.vocab_size, h)
    weights = ModelWeights(embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)
    return Model(
        cfg, weights, device=device, dtype=dtype, ops_backend=ops_backend, max_position=max_position
    )


def _linear_attn(cfg: ModelConfig, w, ones, device: torch.device) -> LinearAttnWeights:
    """A Gated DeltaNet layer's random weights. The decay follows the released models' init
    ranges (A in [1, 16], dt in [1e-3, 0.1] log-uniform), so states neither blow up nor
    forget at once; the gated norm's weight is 1 (the checkpoint's own, read as is)."""
    la = cfg.linear_attn
    hv = la.num_value_heads
    ramp = torch.linspace(0.0, 1.0, hv, device=device, dtype=torch.float32)  # [Hv]
    a = 1.0 + 15.0 * ramp
    dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * ramp.flip(0))
    return LinearAttnWeights(
        in_proj=w(la.conv_dim + la.value_dim + 2 * hv, cfg.hidden_size),
        conv=w(la.conv_kernel, la.conv_dim, std=la.conv_kernel**-0.5),
        neg_a=-a,
        dt_bias=dt + torch.log(-torch.expm1(-dt)),  # softplus^-1(dt)
        norm=ones(la.value_head_dim),
        out_proj=w(cfg.hidden_size, la.value_dim),
    )
