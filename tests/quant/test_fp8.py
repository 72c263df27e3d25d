"""FP8 checkpoints with per-tensor, per-channel and 128 x 128 block scales (the last as Qwen3's
FP8 release stores them: `weight_scale_inv`, `weight_block_size`) load on the CPU dequantized
into the dense weights they stand for; the GPU's W8A8 product (`scaled_mm_linear`: dynamic
per-token activation scales, row-wise `torch._scaled_mm`) is checked here on the GPU where there
is one, else through torch's CPU implementation of the same call."""

from __future__ import annotations

import pytest
import torch

from executor.loader import load_model
from executor.quant import fp8
from tests.fixtures.tiny_models import make_tiny_model
from tests.quant.forward import greedy, prompt_logits
from tests.quant.quant_fixture import write_dense_copy, write_fp8

PROMPT = [5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 33, 2]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    # qwen3: q/k/v of 64 / 32 / 32 rows and an o_proj of 64 inputs cut 128 x 128 blocks short
    return make_tiny_model(
        tmp_path_factory.mktemp("fp8"), "qwen3", seed=40, hidden_size=128, intermediate_size=320
    )


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_checkpoint_loads_dequantized_on_cpu(dense_dir, tmp_path, strategy):
    weights = write_fp8(dense_dir, tmp_path / "q", strategy)
    model = load_model(tmp_path / "q", dtype="float32")
    dense = load_model(write_dense_copy(dense_dir, weights, tmp_path / "d"), dtype="float32")
    for got, want in zip(
        vars(model.weights.layers[0]).values(), vars(dense.weights.layers[0]).values()
    ):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(prompt_logits(model, PROMPT), prompt_logits(dense, PROMPT))
    assert greedy(model, PROMPT, 6) == greedy(dense, PROMPT, 6)


def _fp8_weight(n: int, k: int, seed: int):
    w = torch.randn((n, k), generator=torch.Generator().manual_seed(seed)) * 0.05
    scale = w.abs().amax(1) / fp8.FP8_MAX  # [N]
    return (w / scale[:, None]).to(fp8.FP8), scale


def test_w8a8_product_tracks_the_dequantized_weight():
    # on a GPU where there is one: some torch builds' CPU _scaled_mm lacks row-wise scales
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    weight, scale = (t.to(dev) for t in _fp8_weight(48, 256, seed=1))
    x = torch.randn((5, 256), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[3] *= 40.0  # one row far larger: per-token scales keep the others exact
    x, bias = x.to(dev), torch.randn(48).to(torch.bfloat16).to(dev)
    layer = fp8.Fp8Linear(weight, scale, torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.dequantize().float(), bias.float())
    out = fp8.scaled_mm_linear(x, weight, scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 48)
    rel = (out.float() - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max() < 0.05, rel  # e4m3 activations: 3 mantissa bits
    torch.testing.assert_close(layer(x, bias).float(), ref, rtol=2e-2, atol=2e-2)  # reference path


def test_block_scales_become_per_channel_for_the_gpu_product():
    n, k = 200, 256  # a ragged last block of rows
    w = torch.randn((n, k), generator=torch.Generator().manual_seed(3))
    w[:128, :128] *= 20.0  # blocks of very different ranges within a row
    scale = (
        torch.stack(
            [
                torch.stack([w[r : r + 128, c : c + 128].abs().amax() for c in (0, 128)])
                for r in (0, 128)
            ]
        )
        / fp8.FP8_MAX
    )  # [2, 2]
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    q = (w / full).to(fp8.FP8)
    exact = fp8.dequantize_fp8(q, scale, (128, 128), torch.float32)
    torch.testing.assert_close(exact, q.float() * full, rtol=0, atol=0)
    weight, row = fp8.per_channel(q, scale, (128, 128))
    assert row.shape == (n,) and weight.dtype == fp8.FP8
    again = weight.float() * row[:, None]
    assert ((again - exact).abs() <= exact.abs() / 16 + row[:, None] * 2**-9).all()
    fused = fp8.Fp8Linear.cat([fp8.Fp8Linear(weight, row, torch.float32)] * 2)
    assert fused.out_features == 2 * n and fused.nbytes == 2 * n * (k + 4)
