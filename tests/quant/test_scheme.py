"""Quantized checkpoints the loader does not read stop at load with a one-line reason naming
their quant_method and variant, before any weight is read; the accepted variants parse into
their schemes."""

from __future__ import annotations

import json
import shutil

import pytest

from executor.loader import load_model
from executor.model_config import ModelLoadError
from executor.quant.scheme import quant_scheme
from tests.fixtures.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("dense"), "qwen3", seed=4)


def _with_config(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _ct(fmt: str, weights: dict, acts: dict | None = None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        **extra,
    }


INT8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
REFUSED = [
    (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        ("'bitsandbytes 4-bit nf4'",),
    ),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, ("'gptq 8-bit g128",)),
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
        ("gptq", "format marlin"),
    ),
    ({"quant_method": "gptq", "bits": 4, "group_size": 256}, ("gptq", "g256", "group size")),
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True},
        ("gptq", "quantized lm_head"),
    ),
    (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
        ("'awq 4-bit g128 version gemv'",),
    ),
    (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
        ("awq", "without zero points"),
    ),
    (
        _ct("int-quantized", INT8, {"num_bits": 8, "type": "int", "dynamic": True}),
        ("compressed-tensors int-quantized int8 channel with activations",),
    ),
    (
        _ct("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "tensor"}),
        ("compressed-tensors pack-quantized int4 tensor",),
    ),
    (
        _ct(
            "float-quantized",
            {"num_bits": 8, "type": "float", "strategy": "channel"},
            kv_cache_scheme={"num_bits": 8, "type": "float"},
        ),
        ("compressed-tensors float-quantized", "KV cache"),
    ),
    ({"quant_method": "fp8", "fmt": "e5m2"}, ("'fp8 e5m2 dynamic'",)),
    ({"quant_method": "hqq", "bits": 4}, ("'hqq 4-bit'",)),
    ({"quant_method": "mxfp4"}, ("'mxfp4'",)),
]


@pytest.mark.parametrize(("quant", "words"), REFUSED, ids=lambda v: str(v)[:40])
def test_unsupported_checkpoint_is_refused_in_one_line(tiny_dir, tmp_path, quant, words):
    key = "compression_config" if quant.get("format") == "int-quantized" else "quantization_config"
    model_dir = _with_config(tiny_dir, tmp_path / "m", **{key: quant})
    # the weights would load: only the refusal stands in the way
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as err:
        load_model(model_dir)
    message = str(err.value)
    assert "\n" not in message and message.startswith("quantized checkpoint: quant_method")
    for word in words:
        assert word in message, message


ACCEPTED = [
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
        ("gptq", 128, True, 1),
    ),
    (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
        ("gptq", 32, False, 0),
    ),
    (
        {
            "quant_method": "awq",
            "w_bit": 4,
            "q_group_size": 64,
            "version": "GEMM",
            "zero_point": True,
        },
        ("awq", 64, False, 0),
    ),
    (
        _ct(
            "pack-quantized",
            {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 128,
                "symmetric": True,
            },
        ),
        ("int4-pack", 128, True, 0),
    ),
    (
        _ct(
            "pack-quantized",
            {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False},
        ),
        ("int4-pack", -1, False, 0),
    ),
]


@pytest.mark.parametrize(("quant", "expected"), ACCEPTED, ids=lambda v: str(v)[:40])
def test_supported_int4_variants_parse(quant, expected):
    s = quant_scheme({"quantization_config": quant})
    assert (s.method, s.group_size, s.sym, s.zero_offset) == expected


def test_fp8_variants_parse():
    block = quant_scheme(
        {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            }
        }
    )
    assert (block.method, block.weight_block) == ("fp8", (128, 128))
    ct = quant_scheme(
        {
            "quantization_config": _ct(
                "float-quantized",
                {"num_bits": 8, "type": "float", "strategy": "channel"},
                {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            )
        }
    )
    assert (ct.method, ct.weight_block, ct.activation_scheme) == ("fp8", None, "dynamic")
    assert quant_scheme({"torch_dtype": "bfloat16"}) is None


def test_packed_tensors_without_a_quantization_config_are_refused(tmp_path):
    """A checkpoint whose tensors are packed but whose config says nothing would otherwise be
    read as a model missing its weights, or worse: it names what it found."""
    from tests.quant.quant_fixture import write_int4

    src = make_tiny_model(tmp_path / "dense", "llama", seed=2)
    write_int4(src, tmp_path / "gptq", "gptq", 32)
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="holds qweight tensors but its quantization_config"):
        load_model(tmp_path / "gptq")
