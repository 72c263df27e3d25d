"""Tiny random Qwen3.5 (dense, hybrid) checkpoints made offline with transformers.

`make_tiny_qwen3_5(path)` writes a `Qwen3_5ForCausalLM` directory (config, safetensors, the
byte-level tokenizer of `tests.fixtures.tiny_models`). Its 4 layers follow the default
`full_attention_interval` of 4 (three Gated DeltaNet layers, then one gated full-attention
layer); key and value heads differ in count and size, so a mixed-up axis shows.
`as_multimodal_layout(src, dst)` rewrites one into the released
`Qwen3_5ForConditionalGeneration` layout, vision-tower and MTP tensors included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.fixtures.tiny_models import make_tokenizer

TEXT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def make_tiny_qwen3_5(path: Path | str, seed: int = 0, **config) -> Path:
    """A tiny random checkpoint; `config` overrides Qwen3_5TextConfig fields."""
    import torch
    import transformers as tf

    path = Path(path)
    vocab_size = make_tokenizer(path)
    cfg = tf.Qwen3_5TextConfig(vocab_size=vocab_size, **{**TEXT_CONFIG, **config})
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForCausalLM(cfg)
    # Larger than transformers' init so logits are not flat; zero-centred norms get weights
    # away from 0, so a norm read without its `1 +` is caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.8, 1.2)
            elif "norm" in name:
                p.uniform_(-0.2, 0.2)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    gen = {"eos_token_id": [0], "bos_token_id": None, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def as_multimodal_layout(src: Path, dst: Path) -> Path:
    """`src` re-saved as the released layout: text fields under `text_config`, the text
    weights under `model.language_model.`, plus vision-tower and MTP tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures", None)
    outer = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": text.pop("tie_word_embeddings", False),
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32, "out_hidden_size": 64},
    }
    (dst / "config.json").write_text(json.dumps(outer, indent=1))
    sd = load_file(str(src / "model.safetensors"))
    renamed = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in sd.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 16, 16)
    renamed["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(renamed, str(dst / "model.safetensors"))
    return dst
