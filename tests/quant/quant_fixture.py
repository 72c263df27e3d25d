"""Tiny quantized HF checkpoints written offline from a tiny dense one, in every layout the loader
accepts; the tensors come from `loadtests.lab.quant_layouts`, which encodes each format from its
published description (not from the loader's code). Every writer returns the dense weights its
checkpoint stands for, which `write_dense_copy` saves as the reference checkpoint. A block
drafter's layers (`layers.N.`, no `model.` prefix) are found too, and `extra_linears` names
further linear layers to quantize (a block drafter's `fc`).
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

from safetensors.torch import load_file, save_file

from loadtests.lab.quant_layouts import (
    LINEARS,
    encode_fp8,
    encode_int4,
    fp8_config,
    group_index,
    int4_config,
)

_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.(.+)\.weight$")


def _layers(sd: dict, extra_linears: tuple[str, ...] = ()):
    for name in list(sd):
        m = _LAYER.match(name)
        if not name.endswith(".weight"):
            continue
        if (m and m.group(1) in LINEARS) or name[: -len(".weight")] in extra_linears:
            yield name[: -len(".weight")]


def _input_of(prefix: str) -> str:
    """Layers reading the same input (q/k/v, gate/up) share it: act-order gives them one order,
    as their inputs' statistics are the same."""
    if "." not in prefix:  # a layer outside the decoder layers (a block drafter's fc)
        return prefix
    layer, name = prefix.rsplit(".", 2)[0], prefix.rsplit(".", 1)[1]
    return layer + {"k_proj": ".q_proj", "v_proj": ".q_proj", "up_proj": ".gate_proj"}.get(
        name, "." + name
    )


def write_int4(
    src: Path,
    dst: Path,
    fmt: str,
    group_size: int,
    sym: bool = True,
    act_order: bool = False,
    gptq_format: str = "gptq",
    shared_order: bool = True,
    extra_linears: tuple[str, ...] = (),
) -> dict:
    """Writes `src` quantized as `fmt` ('gptq', 'awq', 'pack-quantized') into `dst`; returns the
    dense state dict it stands for. `shared_order=False` gives every layer its own act-order."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    dense, out = dict(sd), {n: t for n, t in sd.items()}
    for prefix in _layers(sd, extra_linears):
        w = out.pop(prefix + ".weight").float()  # [N, K]
        k = w.shape[1]
        size = k if group_size == -1 else group_size
        seed = zlib.crc32((_input_of(prefix) if shared_order else prefix).encode())
        g_idx = group_index(k, size, act_order, seed=seed)
        tensors, dense[prefix + ".weight"] = encode_int4(
            w, fmt, g_idx, k // size, sym, act_order, gptq_format
        )
        out |= {f"{prefix}.{suffix}": t for suffix, t in tensors.items()}
    save_file({n: t.contiguous() for n, t in out.items()}, str(dst / "model.safetensors"))
    _set_quant_config(dst, int4_config(fmt, group_size, sym, act_order, gptq_format))
    return dense


def _set_quant_config(dst: Path, quant: dict) -> None:
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))


def write_fp8(
    src: Path,
    dst: Path,
    strategy: str,
    block: tuple[int, int] = (128, 128),
    extra_linears: tuple[str, ...] = (),
) -> dict:
    """Writes `src` with FP8 linear layers, scales per 'tensor', 'channel' or 'block'; returns
    the dense state dict it stands for (weight * scale)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    dense, out = dict(sd), dict(sd)
    for prefix in _layers(sd, extra_linears):
        tensors, dense[prefix + ".weight"] = encode_fp8(
            out.pop(prefix + ".weight"), strategy, block
        )
        out |= {f"{prefix}.{suffix}": t for suffix, t in tensors.items()}
    save_file({n: t.contiguous() for n, t in out.items()}, str(dst / "model.safetensors"))
    _set_quant_config(dst, fp8_config(strategy, block))
    return dense


def write_dense_copy(src: Path, weights: dict, dst: Path) -> Path:
    """`src` with its safetensors replaced by `weights` (float32) and no quantization_config."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(
        {n: t.float().contiguous() for n, t in weights.items()}, str(dst / "model.safetensors")
    )
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst
