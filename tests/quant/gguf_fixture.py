"""Tiny GGUF checkpoints written offline with the `gguf` package's writer from a tiny HF model
(tests/fixtures/tiny_models.py), laid out as llama.cpp's converter lays them out: GGUF tensor
names, llama's q/k rows reordered for interleaved rotary, the byte-level BPE vocabulary and
merges, the chat template in the metadata.

Q8_0 and BF16 blocks come from `gguf.quants.quantize`. The package has no Q4_K / Q6_K encoder,
so `encode_q4_k` / `encode_q6_k` write those blocks from llama.cpp's layout description (a
plain absmax choice of scales, not its search); `gguf.quants.dequantize` decodes every block
independently of the loader, and `write_gguf` returns those decoded weights under HF names:
the dense checkpoint the GGUF stands for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QK_K = 256
# HF name (after model.layers.N.) -> GGUF name (after blk.N.)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# GGUF tensor kind -> format wanted (K-quants fall back to Q8_0 for rows under 256 values)
DEFAULT_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "Q6_K",
}


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [n, 2]


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q4_K bytes [rows, K / 256 * 144]."""
    rows = x.shape[0]
    b = x.reshape(-1, 8, 32).astype(np.float32)  # [nb, sub-block, value]
    lo = np.minimum(b.min(axis=2), 0.0)
    hi = b.max(axis=2)
    scale = (hi - lo) / 15.0  # [nb, 8]
    mins = -lo
    d = (scale.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)  # [nb]
    dmin = (mins.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # [nb, 8]
    q = np.round((b + (dmin[:, None] * m)[:, :, None]) / np.where(step > 0, step, 1)[:, :, None])
    q = np.clip(q, 0, 15).astype(np.uint8)  # [nb, 8, 32]
    packed_scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=1,
    )  # [nb, 12]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # pairs of sub-blocks share bytes
    out = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), packed_scales, qs], axis=1)
    return out.reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q6_K bytes [rows, K / 256 * 210]."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)  # [nb, group, value]
    group = np.abs(b).max(axis=2) / 31.0  # [nb, 16]
    d = (group.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)  # [nb]
    sc = np.clip(np.round(group / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.round(b / np.where(step != 0, step, 1)[:, :, None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves
    ql = np.concatenate(
        [
            (q[:, :, 0:32] & 15) | ((q[:, :, 64:96] & 15) << 4),
            (q[:, :, 32:64] & 15) | ((q[:, :, 96:128] & 15) << 4),
        ],
        axis=2,
    ).reshape(-1, 128)
    qh = (
        (q[:, :, 0:32] >> 4)
        | ((q[:, :, 32:64] >> 4) << 2)
        | ((q[:, :, 64:96] >> 4) << 4)
        | ((q[:, :, 96:128] >> 4) << 6)
    ).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)
    return out.reshape(rows, -1)


def llama_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (each head's halves interleaved pair by pair)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _encode(w: np.ndarray, kind: str):
    """(bytes or float array, ggml type) of one tensor in the format `kind`."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if w.ndim == 1 or kind == "F32":
        return w.astype(np.float32), T.F32
    cols = w.shape[-1]
    if kind in ("Q4_K", "Q6_K") and cols % QK_K:
        kind = "Q8_0"
    if kind == "Q8_0" and cols % 32:
        kind = "F16"
    if kind == "Q4_K":
        return encode_q4_k(w), T.Q4_K
    if kind == "Q6_K":
        return encode_q6_k(w), T.Q6_K
    if kind == "F16":
        return w.astype(np.float16), T.F16
    qtype = getattr(T, kind)
    return quants.quantize(w.astype(np.float32), qtype), qtype


def _vocab(model_dir: Path) -> tuple[list[str], list[int], list[str]]:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    types = [3 if i in special else 1 for i in range(len(tokens))]  # CONTROL / NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


def write_gguf(model_dir: Path, path: Path, arch: str, types: dict[str, str] | None = None):
    """Writes `model_dir` (a tiny HF checkpoint of `arch`) as a GGUF file at `path`; returns
    {HF name: float32 tensor} of the weights the file holds, decoded by `gguf.quants`."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from tests.fixtures.tiny_models import CHAT_TEMPLATE

    types = {**DEFAULT_TYPES, **(types or {})}
    cfg = json.loads((model_dir / "config.json").read_text())
    sd = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta"))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens, token_types, merges = _vocab(model_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    decoded = {}
    for name, tensor in sd.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{LAYER_NAMES[rest]}"
        else:
            gname = GLOBAL_NAMES[name]
        x = tensor.float().numpy()
        kind = gname.split(".")[-2]
        fmt = types.get(kind, "F32")
        src = x
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            src = llama_permute(x, heads if kind == "attn_q" else kv_heads)
        data, qtype = _encode(src, fmt)
        w.add_tensor(gname, data, raw_dtype=qtype)
        # blocks run along rows: the HF-order rows decode to what the file's reordered rows hold
        hf_data = data if src is x else _encode(x, fmt)[0]
        back = gguf.quants.dequantize(hf_data, qtype).reshape(x.shape).astype(np.float32)
        decoded[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def write_dense_copy(model_dir: Path, weights: dict, out_dir: Path) -> Path:
    """`model_dir` with its safetensors replaced by `weights` (float32): the HF checkpoint a
    quantized file decodes to."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"))
    return out_dir
