"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (tests/quant/quant_fixture.py)
load with their linear layers still packed, and give the logits and greedy tokens of the dense
checkpoint holding the weights they stand for (fp32 on the CPU: the torch reference path)."""

from __future__ import annotations

import pytest
import torch

from executor.loader import load_model
from executor.model_config import ModelLoadError
from executor.quant.int4 import Int4Linear
from tests.fixtures.tiny_models import make_tiny_model
from tests.quant.forward import greedy, prompt_logits
from tests.quant.quant_fixture import write_dense_copy, write_int4

# (arch, format, group size, symmetric, act-order, GPTQ checkpoint_format)
CASES = [
    ("llama", "gptq", 128, True, False, "gptq"),
    ("qwen2", "gptq", 64, False, True, "gptq_v2"),
    ("qwen3", "gptq", 32, False, False, "gptq"),
    ("qwen3", "awq", 32, False, False, None),
    ("llama", "awq", 128, False, False, None),
    ("qwen3", "pack-quantized", 32, True, False, None),
    ("llama", "pack-quantized", 64, False, True, None),
    ("qwen2", "pack-quantized", -1, True, False, None),
]
PROMPT = [5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 33, 2]


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    # 128 inputs to every projection but qwen3's o_proj (64): group 128 fits llama
    shape = {"hidden_size": 128, "intermediate_size": 256}
    return {
        a: make_tiny_model(tmp_path_factory.mktemp(a), a, seed=20 + i, **shape)
        for i, a in enumerate(("llama", "qwen2", "qwen3"))
    }


@pytest.mark.parametrize(("arch", "fmt", "group", "sym", "act_order", "gptq_fmt"), CASES)
def test_int4_checkpoint_matches_its_dense_weights(
    dense_dirs, tmp_path, arch, fmt, group, sym, act_order, gptq_fmt
):
    dense_sd = write_int4(
        dense_dirs[arch], tmp_path / "q", fmt, group, sym, act_order, gptq_fmt or "gptq"
    )
    quant = load_model(tmp_path / "q", dtype="float32")
    dense = load_model(
        write_dense_copy(dense_dirs[arch], dense_sd, tmp_path / "d"), dtype="float32"
    )
    layer = quant.weights.layers[0]
    for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
        assert isinstance(w, Int4Linear)
        assert (w.g_idx is not None) == act_order
    assert quant.weights.lm_head.dtype == torch.float32  # left dense
    for qw, dw in zip(vars(layer).values(), vars(dense.weights.layers[0]).values()):
        if isinstance(qw, Int4Linear):
            torch.testing.assert_close(qw.dequantize(), dw, rtol=0, atol=0)
    ref = prompt_logits(dense, PROMPT)
    torch.testing.assert_close(prompt_logits(quant, PROMPT), ref, rtol=1e-5, atol=1e-5)
    assert greedy(quant, PROMPT, 6) == greedy(dense, PROMPT, 6)
    assert quant.num_params == dense.num_params


def test_int4_weights_are_smaller_than_dense(dense_dirs, tmp_path):
    write_int4(dense_dirs["llama"], tmp_path / "q", "awq", 32, sym=False)
    model = load_model(tmp_path / "q", dtype="float16")
    w = model.weights.layers[0].gate_up
    dense_bytes = w.numel() * 2
    assert w.nbytes < dense_bytes * 0.4  # 4 bits, fp16 scales and uint8 zeros per 32 inputs


def test_fused_layers_with_different_act_orders_are_refused(dense_dirs, tmp_path):
    write_int4(dense_dirs["qwen2"], tmp_path / "q", "gptq", 64, act_order=True, shared_order=False)
    with pytest.raises(ModelLoadError, match="different groups or act-order indices"):
        load_model(tmp_path / "q", dtype="float32")
