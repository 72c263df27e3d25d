"""A Qwen3.5 dense checkpoint's text weights into `ModelWeights` (the loader calls it for hybrid
configs). The text model sits under `model.` (`Qwen3_5ForCausalLM`) or `model.language_model.`
(the released multimodal layout, whose vision tower and multi-token-prediction head are never
read). Checkpoint norms are zero-centred (`x * (1 + w)`): `1 + w` is folded in at load, except
the linear layers' gated norm, which multiplies by `w` itself."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.linear_attention import LinearAttnWeights
from executor.model import LayerWeights, ModelWeights
from executor.model_config import ModelConfig, ModelLoadError

# read by nothing: the loader skips them without loading their tensors
IGNORED_PREFIXES = ("model.visual.", "mtp.")


def hybrid_weights(
    sd: dict[str, torch.Tensor],
    config: ModelConfig,
    take: Callable[[str], torch.Tensor],  # a named tensor, in the model's dtype and device
    quantized: bool = False,
) -> ModelWeights:
    if quantized:
        raise ModelLoadError(f"{config.arch}: quantized hybrid checkpoints are not supported")
    root = (
        "model.language_model."
        if any(n.startswith("model.language_model.") for n in sd)
        else "model."
    )

    def norm(name: str) -> torch.Tensor:
        w = take(name)
        return (1.0 + w.float()).to(w.dtype)

    layers = []
    for i, kind in enumerate(config.layer_types):
        p = f"{root}layers.{i}."
        common = dict(
            input_norm=norm(p + "input_layernorm.weight"),
            post_norm=norm(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            down=take(p + "mlp.down_proj.weight"),
        )
        if kind == "linear_attention":
            layers.append(
                LayerWeights(
                    qkv=None,
                    qkv_bias=None,
                    q_norm=None,
                    k_norm=None,
                    o_proj=None,
                    linear_attn=_linear_attn(p + "linear_attn.", take),
                    **common,
                )
            )
            continue
        a = p + "self_attn."
        # q_proj holds per head [q (head_dim) | gate (head_dim)]: split so that qkv's columns
        # are q | k | v as the fused q/k kernel reads them, with the gate after them.
        q_gate = take(a + "q_proj.weight").view(config.num_q_heads, 2, config.head_dim, -1)
        qkv = torch.cat(
            [
                q_gate[:, 0].flatten(0, 1),
                take(a + "k_proj.weight"),
                take(a + "v_proj.weight"),
                q_gate[:, 1].flatten(0, 1),
            ]
        ).contiguous()
        layers.append(
            LayerWeights(
                qkv=qkv,
                qkv_bias=None,
                q_norm=norm(a + "q_norm.weight"),
                k_norm=norm(a + "k_norm.weight"),
                o_proj=take(a + "o_proj.weight"),
                **common,
            )
        )
    embed = take(root + "embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in sd
    return ModelWeights(
        embed=embed,
        layers=tuple(layers),
        final_norm=norm(root + "norm.weight"),
        lm_head=embed if tied else take("lm_head.weight"),
    )


def _linear_attn(p: str, take: Callable[[str], torch.Tensor]) -> LinearAttnWeights:
    # the decay's parameters go to fp32 from the checkpoint's dtype, as transformers does
    a_log, dt_bias = take(p + "A_log"), take(p + "dt_bias")
    return LinearAttnWeights(
        in_proj=torch.cat(
            [take(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
        ).contiguous(),
        conv=take(p + "conv1d.weight")[:, 0].t().contiguous(),  # [C, 1, K] -> [K, C]
        neg_a=-a_log.float().exp(),
        dt_bias=dt_bias.float(),
        norm=take(p + "norm.weight"),
        out_proj=take(p + "out_proj.weight"),
    )
