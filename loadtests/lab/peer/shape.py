"""The model's shape, shared by both engines: resolved from `random:NAME` or a checkpoint, written
as the Hugging Face config.json vLLM builds its dummy-weight model from, and the bytes one
decode step reads (the roofline's)."""

from __future__ import annotations

import json
from pathlib import Path

from executor.model_config import ModelConfig, load_model_config

MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
# shapes vLLM is not given (no config.json of them is written): this engine runs them alone
NO_PEER_CONFIG = ("Qwen3_5ForCausalLM",)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def resolve_shape(model: str) -> ModelConfig:
    """The shape of `random:NAME` (a preset) or of a checkpoint directory; ValueError with one
    line for anything else."""
    if model.startswith("random:"):
        from executor.random_model import PRESETS

        name = model.split(":", 1)[1]
        if name not in PRESETS:
            raise ValueError(f"unknown random model {name!r} (choose {', '.join(PRESETS)})")
        return PRESETS[name]
    return load_model_config(model)  # its ModelLoadError is a ValueError with one line


def hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face config.json of this shape (default RoPE: the random presets have it)."""
    return {
        "architectures": [cfg.arch],
        "model_type": MODEL_TYPES[cfg.arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_q_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope.theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "torch_dtype": cfg.torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    }


def write_hf_config(cfg: ModelConfig, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return folder


def num_params(cfg: ModelConfig) -> int:
    """Parameters of the model, counted as `executor.model.Model.num_params` counts them: a
    hybrid target's linear-attention layers (in/out projections, conv, decay and norm weights)
    beside its full-attention ones (whose q projection also holds the output gate)."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    mlp_norms = 2 * h + 3 * cfg.intermediate_size * h
    q_out = 2 * q if cfg.attn_output_gate else q
    attn = (q_out + 2 * kv) * h + q * h
    attn += (q_out + 2 * kv) if cfg.qkv_bias else 0
    attn += 2 * cfg.head_dim if cfg.qk_norm else 0
    num_linear = len(cfg.linear_layer_ids) if cfg.is_hybrid else 0
    linear = 0
    if num_linear:
        la = cfg.linear_attn
        nv = la.num_value_heads
        linear = (la.conv_dim + la.value_dim + 2 * nv) * h + la.value_dim * h
        linear += la.conv_kernel * la.conv_dim + 2 * nv + la.value_head_dim
    embed = cfg.vocab_size * h
    layers = cfg.num_layers * mlp_norms + (cfg.num_layers - num_linear) * attn
    return embed * (1 if cfg.tie_word_embeddings else 2) + h + layers + num_linear * linear


def state_bytes_per_seq(cfg: ModelConfig, dtype_bytes: int) -> int:
    """A hybrid target's recurrent state per sequence, which a decode step reads and writes
    once; 0 for other targets."""
    from executor.recurrent_state import RecurrentStates

    return RecurrentStates.bytes_per_slot(cfg, dtype_bytes) if cfg.is_hybrid else 0


def step_weight_bytes(cfg: ModelConfig, dtype_bytes: int, num_seqs: int) -> int:
    """Weight bytes one decode step of `num_seqs` rows reads: every weight once, but of an
    untied input embedding only the rows' own lines."""
    embed = cfg.vocab_size * cfg.hidden_size
    untied = 0 if cfg.tie_word_embeddings else embed - num_seqs * cfg.hidden_size
    return (num_params(cfg) - untied) * dtype_bytes


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters a row multiplies through (2 FLOPs each): all but the input embedding and norms."""
    h = cfg.hidden_size
    num_attn = cfg.num_layers - (len(cfg.linear_layer_ids) if cfg.is_hybrid else 0)
    norms = 2 * h * cfg.num_layers + (2 * cfg.head_dim * num_attn if cfg.qk_norm else 0) + h
    input_embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return num_params(cfg) - norms - input_embed


def dtype_of(cfg: ModelConfig, requested: str) -> str:
    """The weights' dtype both engines run: the requested one, else the shape's own."""
    name = cfg.torch_dtype if requested == "auto" else requested
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {name!r} (choose {', '.join(DTYPE_BYTES)})")
    return name
