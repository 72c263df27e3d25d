"""A GGUF file as the loader's inputs: the model's shape (`gguf_model_config`, from the
`<arch>.*` metadata) and its weights under Hugging Face names, dequantized into the model's
dtype on the target device (`gguf_state_dict`).

llama.cpp's converter reorders the rows of a llama model's q and k projections for GGML's
interleaved rotary embedding (each head's halves interleaved pair by pair); qwen2 and qwen3 keep
Hugging Face's half-split order. The model here rotates halves, so llama's rows are put back.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from executor.gguf import blocks
from executor.gguf.files import GGUFMetadata
from executor.model_config import SUPPORTED_ARCHS, ModelConfig, ModelLoadError, decoder_config

# GGUF general.architecture -> the Hugging Face architecture of the same model
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# general.file_type -> the dtype the weights were converted from (others: bf16)
_FILE_DTYPES = {0: "float32", 1: "float16"}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, None for a name this loader does not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _rope_scaling(meta: GGUFMetadata) -> dict | None:
    kind = meta.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
    scaling = {"rope_type": kind, "factor": _f32(meta.arch_get("rope.scaling.factor", 1.0))}
    original = meta.arch_get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _f32(value) -> float:
    """A float32 field as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _required(meta: GGUFMetadata, key: str):
    value = meta.arch_get(key)
    if value is None:
        raise ModelLoadError(f"{meta.path.name}: GGUF metadata lacks {meta.arch}.{key}")
    return value


def _check_tensors(meta: GGUFMetadata) -> dict:
    tensors = {t.name: t for t in meta.reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(
            f"{meta.path.name} carries rope frequency factors (llama3-style rope scaling), "
            "which GGUF loading does not support"
        )
    unknown = [n for n in tensors if hf_name(n) is None]
    if unknown:
        raise ModelLoadError(f"{meta.path.name}: unexpected tensor {unknown[0]!r} for {meta.arch}")
    kinds = {int(t.tensor_type) for t in tensors.values()}
    bad = sorted(kinds - set(blocks.BLOCKS))
    if bad:
        from gguf import GGMLQuantizationType

        names = ", ".join(GGMLQuantizationType(k).name for k in bad)
        raise ModelLoadError(
            f"{meta.path.name} holds {names} tensors; GGUF loading supports "
            f"{', '.join(blocks.NAMES.values())}"
        )
    return tensors


def gguf_model_config(path: Path) -> ModelConfig:
    """The decoder's shape from the file's metadata (refused, one line, for an architecture,
    rope scaling or tensor format this loader does not read)."""
    meta = GGUFMetadata(path)
    if meta.arch not in ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {meta.arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    tensors = _check_tensors(meta)
    hf_arch = ARCHS[meta.arch]
    heads = _required(meta, "attention.head_count")
    ffn = _required(meta, "feed_forward_length")
    if isinstance(heads, list) or isinstance(ffn, list):
        raise ModelLoadError(f"{path.name}: per-layer head counts or widths are not supported")
    hidden = int(_required(meta, "embedding_length"))
    head_dim = int(meta.arch_get("attention.key_length") or hidden // int(heads))
    rope_dim = meta.arch_get("rope.dimension_count")
    raw = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.arch_get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": ffn,
        "num_hidden_layers": _required(meta, "block_count"),
        # the embedding's rows, which may exceed the tokenizer's vocabulary (padding)
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "max_position_embeddings": int(meta.arch_get("context_length", 4096)),
        "rms_norm_eps": _f32(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "rope_theta": _f32(meta.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "torch_dtype": _FILE_DTYPES.get(meta.get("general.file_type"), "bfloat16"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
    }
    if rope_dim and int(rope_dim) != head_dim:
        raw["partial_rotary_factor"] = int(rope_dim) / head_dim
    eos = [
        meta.get(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    default_bias, qk_norm = SUPPORTED_ARCHS[hf_arch]
    return decoder_config(
        raw,
        path,
        arch=hf_arch,
        default_bias=default_bias,
        qk_norm=qk_norm,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row order: per head, rows (pair p, half h) back to (h, p)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def gguf_state_dict(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its Hugging Face name, dequantized on `device`."""
    meta = GGUFMetadata(path)
    sd: dict[str, torch.Tensor] = {}
    for t in meta.reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # outermost first: [N, K]
        raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8)).to(device)
        try:
            w = blocks.dequantize(raw, int(t.tensor_type), shape, dtype)
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: tensor {t.name}: {e}") from None
        if meta.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, config.num_q_heads)
        elif meta.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, config.num_kv_heads)
        sd[name] = w.contiguous()
    return sd
