"""Loads a Hugging Face model directory (config + safetensors, sharded or not) into `Model`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from executor.gguf.files import find_gguf_file
from executor.hybrid_loader import IGNORED_PREFIXES, hybrid_weights
from executor.kv_scales import take_kv_scales
from executor.model import LayerWeights, Model, ModelWeights
from executor.model_config import ModelConfig, ModelLoadError, load_model_config
from executor.quant.linear import QuantLinear
from executor.quant.linear_loader import take_linear
from executor.quant.scheme import QuantScheme, read_quant_scheme

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"unsupported dtype {name!r} (choose {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cpu":
        return (
            torch.float32
        )  # CPU matmuls in bf16 are slow and less exact; fp32 is the safe default
    return DTYPES.get(config.torch_dtype, torch.bfloat16)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"missing shard {missing[0]} listed in {index.name}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if not name.startswith(IGNORED_PREFIXES):  # a vision tower, an MTP head
                    tensors[name] = f.get_tensor(name)
    return tensors


def take_weight(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd.pop(name)
    except KeyError:
        raise ModelLoadError(f"checkpoint lacks weight {name!r}") from None


def load_weights(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    scheme: QuantScheme | None = None,
    sd: dict[str, torch.Tensor] | None = None,
) -> ModelWeights:
    """The model's weights from the directory's safetensors (or from `sd`, HF-named); linear
    layers stay packed where `scheme` says the checkpoint is quantized (executor/quant). The
    checkpoint's FP8 KV cache scales, where it has them, come along (`executor/kv_scales.py`)."""
    sd = read_state_dict(model_dir) if sd is None else sd
    # a hybrid's released layout keeps its text model under model.language_model.
    nested = any(n.startswith("model.language_model.") for n in sd)
    prefix = "model.language_model." if nested else "model."
    kv_scales = take_kv_scales(sd, config, device, prefix + "layers.")

    def t(name: str) -> torch.Tensor:
        return take_weight(sd, name).to(device=device, dtype=dtype).contiguous()

    def lin(*prefixes: str):
        # dense [N, K] or a QuantLinear; several prefixes are fused along N
        return take_linear(sd, list(prefixes), scheme, dtype, device)

    if config.is_hybrid:
        weights = hybrid_weights(sd, config, t, quantized=scheme is not None)
        return dataclasses.replace(weights, kv_scales=kv_scales)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        # q, k, v fused into one [q + 2 kv, hidden] matrix: one GEMM instead of three.
        qkv = lin(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat(
                [
                    t(p + "self_attn.q_proj.bias"),
                    t(p + "self_attn.k_proj.bias"),
                    t(p + "self_attn.v_proj.bias"),
                ]
            )
        gate_up = lin(p + "mlp.gate_proj", p + "mlp.up_proj")
        layers.append(
            LayerWeights(
                input_norm=t(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=t(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=t(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                o_proj=lin(p + "self_attn.o_proj"),
                post_norm=t(p + "post_attention_layernorm.weight"),
                gate_up=gate_up,
                down=lin(p + "mlp.down_proj"),
            )
        )
    embed = t("model.embed_tokens.weight")
    if config.tie_word_embeddings or not any(n.startswith("lm_head.") for n in sd):
        lm_head = embed
    else:
        lm_head = lin("lm_head")  # dense: drafters share it through their own GEMM
        lm_head = lm_head.dequantize() if isinstance(lm_head, QuantLinear) else lm_head
    return ModelWeights(
        embed=embed,
        layers=tuple(layers),
        final_norm=t("model.norm.weight"),
        lm_head=lm_head,
        kv_scales=kv_scales,
    )


def load_model(
    model_dir: Path | str,
    *,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    ops_backend: str = "auto",
) -> Model:
    model_dir = Path(model_dir)
    device = torch.device(device)
    gguf_file = find_gguf_file(model_dir)
    if gguf_file is not None:  # a .gguf file, or a directory holding one and no config.json
        from executor.gguf.checkpoint import gguf_model_config, gguf_state_dict

        config = gguf_model_config(gguf_file)
        torch_dtype = resolve_dtype(dtype, config, device)
        sd = gguf_state_dict(gguf_file, config, torch_dtype, device)
        weights = load_weights(model_dir, config, torch_dtype, device, sd=sd)
        return Model(config, weights, device=device, dtype=torch_dtype, ops_backend=ops_backend)
    config = load_model_config(model_dir)
    scheme = read_quant_scheme(model_dir)  # refuses what it does not support, before weights
    torch_dtype = resolve_dtype(dtype, config, device)
    weights = load_weights(model_dir, config, torch_dtype, device, scheme)
    return Model(config, weights, device=device, dtype=torch_dtype, ops_backend=ops_backend)
