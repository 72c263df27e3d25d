"""Which quantized checkpoints load: a config.json's `quantization_config` (or the older
`compression_config`) parsed into one `QuantScheme`, or refused with a one-line reason naming
the `quant_method` and the variant. Nothing else of the loader reads those fields, so a scheme
this module does not accept never reaches the weights (where it would load as garbage).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from executor.model_config import ModelLoadError

SUPPORTED = (
    "gptq 4-bit, awq 4-bit gemm, compressed-tensors pack-quantized int4 or float-quantized fp8, "
    "fp8 e4m3; docs/quantization.md lists the variants"
)
GROUP_SIZES = (-1, 32, 64, 128)  # -1: one group per output channel (the whole input)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's linear layers are stored. `method`: 'gptq', 'awq', 'int4-pack'
    (compressed-tensors pack-quantized) or 'fp8'. Modules a checkpoint leaves unquantized
    (lm_head, `ignore` lists) are found by their tensors, so the scheme does not list them."""

    method: str
    variant: str  # for messages: "gptq 4-bit g128 desc_act"
    group_size: int = -1
    sym: bool = True
    zero_offset: int = 0  # GPTQ's original format stores each zero point minus one
    weight_block: tuple[int, int] | None = None  # fp8: [N, K] block of one scale
    activation_scheme: str = "dynamic"  # fp8: activations are scaled per token at run time


def _refuse(method: str, variant: str, why: str = "is not supported") -> ModelLoadError:
    what = f"{method} {variant}".strip()
    return ModelLoadError(
        f"quantized checkpoint: quant_method {what!r} {why} (supported: {SUPPORTED})"
    )


def _int(q: dict, *keys: str, default: int) -> int:
    for key in keys:
        if q.get(key) is not None:
            return int(q[key])
    return default


def _group(method: str, group: int, variant: str) -> int:
    if group not in GROUP_SIZES:
        raise _refuse(method, variant, "has a group size outside 32/64/128/per-channel")
    return group


def _gptq(q: dict) -> QuantScheme:
    bits = _int(q, "bits", "w_bit", default=4)
    group = _int(q, "group_size", default=-1)
    fmt = str(q.get("checkpoint_format") or "gptq").lower()
    variant = f"{bits}-bit g{group} format {fmt}" + (" desc_act" if q.get("desc_act") else "")
    if bits != 4:
        raise _refuse("gptq", variant)
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", variant)
    if q.get("lm_head"):
        raise _refuse("gptq", variant + " with a quantized lm_head")
    if q.get("dynamic"):
        raise _refuse("gptq", variant + " with per-module overrides ('dynamic')")
    return QuantScheme(
        method="gptq",
        variant=f"gptq {variant}",
        group_size=_group("gptq", group, variant),
        sym=bool(q.get("sym", True)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _awq(q: dict) -> QuantScheme:
    bits = _int(q, "bits", "w_bit", default=4)
    group = _int(q, "group_size", "q_group_size", default=128)
    version = str(q.get("version") or "gemm").lower()
    variant = f"{bits}-bit g{group} version {version}"
    if bits != 4 or version != "gemm":
        raise _refuse("awq", variant)
    if not q.get("zero_point", True):  # the GEMM packing always carries zero points
        raise _refuse("awq", variant + " without zero points")
    return QuantScheme(
        method="awq",
        variant=f"awq {variant}",
        group_size=_group("awq", group, variant),
        sym=False,
    )


def _compressed_tensors(q: dict) -> QuantScheme:
    fmt = str(q.get("format") or "dense")
    sparsity = q.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse("compressed-tensors", f"{fmt} with {sparsity.get('format')} sparsity")
    if q.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors", f"{fmt} with a quantized KV cache")
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse("compressed-tensors", f"{fmt} with {len(groups)} config groups")
    group = groups[0]
    fmt = str(group.get("format") or fmt)
    w = group.get("weights") or {}
    a = group.get("input_activations")
    strategy = str(w.get("strategy") or "tensor")
    kind = f"{w.get('type', 'int')}{w.get('num_bits')}"
    variant = f"{fmt} {kind} {strategy}" + (" with activations" if a else "")
    if fmt == "pack-quantized" and kind == "int4" and strategy in ("group", "channel") and not a:
        size = int(w.get("group_size") or -1) if strategy == "group" else -1
        if w.get("dynamic"):
            raise _refuse("compressed-tensors", variant + " dynamic")
        return QuantScheme(
            method="int4-pack",
            variant=f"compressed-tensors {variant} g{size}",
            group_size=_group("compressed-tensors", size, variant),
            sym=bool(w.get("symmetric", True)),
        )
    if fmt == "float-quantized" and kind == "float8" and strategy in ("tensor", "channel", "block"):
        a_ok = a is None or (str(a.get("type")) == "float" and int(a.get("num_bits", 0)) == 8)
        if not a_ok:
            raise _refuse("compressed-tensors", variant)
        block = w.get("block_structure") if strategy == "block" else None
        return QuantScheme(
            method="fp8",
            variant=f"compressed-tensors {variant}",
            weight_block=tuple(int(b) for b in block) if block else None,
            activation_scheme="dynamic" if a is None or a.get("dynamic") else "static",
        )
    raise _refuse("compressed-tensors", variant)


def _fp8(q: dict) -> QuantScheme:
    fmt = str(q.get("fmt") or "e4m3")
    block = q.get("weight_block_size")
    acts = str(q.get("activation_scheme") or "dynamic")
    variant = f"{fmt}" + (f" block {block[0]}x{block[1]}" if block else "") + f" {acts}"
    if fmt != "e4m3" or (block is not None and len(block) != 2):
        raise _refuse("fp8", variant)
    return QuantScheme(
        method="fp8",
        variant=f"fp8 {variant}",
        weight_block=tuple(int(b) for b in block) if block else None,
        activation_scheme=acts,
    )


_PARSERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}


def quant_scheme(raw_config: dict) -> QuantScheme | None:
    """The scheme of an HF config.json's quantization fields; None when it has none."""
    q = raw_config.get("quantization_config") or raw_config.get("compression_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError(f"quantized checkpoint: quantization_config is not a mapping: {q!r}")
    method = str(q.get("quant_method") or "").lower()
    if not method and q.get("config_groups"):
        method = "compressed-tensors"  # compression_config of older releases names none
    parser = _PARSERS.get(method)
    if parser is None:
        raise _refuse(method or "(none)", _variant_of(q))
    return parser(q)


def _variant_of(q: dict) -> str:
    """A few words on an unknown method's variant: its bits and format fields, as present."""
    words = []
    if q.get("load_in_4bit") or q.get("load_in_8bit"):
        words.append("4-bit" if q.get("load_in_4bit") else "8-bit")
    for key in ("bits", "w_bit", "num_bits"):
        if q.get(key) is not None:
            words.append(f"{q[key]}-bit")
            break
    for key in ("bnb_4bit_quant_type", "version", "format", "fmt", "quant_type"):
        if isinstance(q.get(key), str):
            words.append(q[key])
    return " ".join(words)


def read_quant_scheme(model_dir: Path) -> QuantScheme | None:
    """`quant_scheme` of the directory's config.json (which `load_model_config` has read)."""
    return quant_scheme(json.loads((Path(model_dir) / "config.json").read_text()))
