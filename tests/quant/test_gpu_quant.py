"""GPU checks of the quantized linear layers as the loader builds them: the int4 kernels (the
device family's `INT4_TILES`, bf16) against their torch reference at the Qwen3-8B projections'
shapes and row counts of both kernels; the FP8 product (the W8A16 skinny kernel up to 16 rows,
W8A8 `torch._scaled_mm` row-wise past them) against the dequantized weight; both layers, and a
tiny model's decode step in each layout, replayed from a CUDA graph; the tiny model's logits
against the torch reference path; the engine serving each layout with its decode graphs."""

from __future__ import annotations

import pytest
import torch

from executor.model import AttnMetadata
from executor.quant.linear_loader import take_linear
from executor.quant.scheme import quant_scheme
from executor.random_model import random_model
from kernels.int4_linear import int4_linear, int4_linear_ref
from loadtests.lab.quant_layouts import Layout, quantized_model

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
# Qwen3-8B's fused projections (N, K): qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
ROWS = [1, 2, 3, 8, 16, 17, 64, 128]


def _layer(layout: Layout, n: int, k: int, seed: int):
    """The loader's layer of a random [N, K] weight encoded in `layout`, and the weight."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = (torch.randn((n, k), generator=gen, device=DEVICE) * k**-0.5).to(torch.bfloat16)
    sd = {f"p.{suffix}": t for suffix, t in layout.encode(w).items()}
    scheme = quant_scheme({"quantization_config": layout.config()})
    return take_linear(sd, ["p"], scheme, torch.bfloat16, DEVICE), w


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn((rows, k), generator=gen, device=DEVICE).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int4_kernels_match_the_reference(n, k, rows):
    layer, _ = _layer(Layout("gptq", group_size=128), n, k, seed=n + k)
    x = _x(rows, k, seed=rows)
    args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.group_size, None)
    out, ref = int4_linear(x, *args), int4_linear_ref(x, *args)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 1e-2 * ref.float().abs().max().item(), err


@pytest.mark.parametrize(("n", "k"), SHAPES[:2])
@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_fp8_product_tracks_the_dequantized_weight(n, k, rows):
    layer, _ = _layer(Layout("fp8"), n, k, seed=n + k)
    x = _x(rows, k, seed=rows)
    x[0] *= 30.0  # one row far larger: per-token scales keep the others exact
    out = layer(x, None, kernels=True)
    ref = x.float() @ layer.dequantize().float().t()
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    rel = (out.float() - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max().item() < 0.05, rel.max().item()  # e4m3 activations: 3 mantissa bits


@pytest.mark.parametrize("kind", ["gptq", "fp8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_layers_replay_from_a_cuda_graph(kind, rows):
    layer, _ = _layer(Layout(kind), 6144, 4096, seed=3)
    static_x = _x(rows, 4096, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles and workspaces outside the capture
            layer(static_x, None, kernels=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, None, kernels=True)
    for seed in (5, 6):
        x = _x(rows, 4096, seed=seed)
        static_x.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_out, layer(x, None, kernels=True), rtol=1e-3, atol=1e-3)


TINY_LAYOUTS = [Layout("gptq", group_size=32), Layout("fp8", fp8_block=(32, 32))]


def _meta(num_rows: int, num_blocks: int = 4) -> AttnMetadata:
    """One sequence's prefill of `num_rows` rows into blocks 0.. in order (slot = position)."""
    positions = torch.arange(num_rows, device=DEVICE)
    return AttnMetadata(
        positions=positions,
        slot_mapping=positions,
        cu_q_lens=torch.tensor([0, num_rows], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([num_rows], dtype=torch.int32, device=DEVICE),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=DEVICE)[None],
    )


def _prompt_logits(model, ids: list[int]) -> torch.Tensor:
    from executor.kv_cache import KVCache

    blocks = -(-len(ids) // 16)
    kv = KVCache.for_model(model, num_blocks=blocks, block_size=16)
    hidden = model.forward(torch.tensor(ids, device=DEVICE), _meta(len(ids), blocks), kv.k, kv.v)
    return model.logits(hidden)  # [len(ids), vocab]


# (layout kind, prompt rows) -> the largest relative logit error allowed: 12 rows take the
# skinny kernels (weights exact, bf16 roundings only), as do 40 rows of FP8; 40 and 80 rows take
# int4's tiled kernel, 80 rows of FP8 `torch._scaled_mm` with the activations rounded to e4m3
# (3 mantissa bits) at every layer
LOGIT_TOLERANCE = {("gptq", 12): 0.03, ("gptq", 40): 0.05, ("gptq", 80): 0.05}
LOGIT_TOLERANCE |= {("fp8", 12): 0.03, ("fp8", 40): 0.03, ("fp8", 80): 0.1}


@pytest.mark.parametrize("rows", [12, 40, 80])
@pytest.mark.parametrize("layout", TINY_LAYOUTS, ids=lambda lay: lay.kind)
def test_tiny_model_kernels_match_the_reference_path(layout, rows):
    dense = random_model("tiny", device=DEVICE, dtype=torch.bfloat16)
    kernels = quantized_model(dense, layout)
    reference = quantized_model(dense, layout, ops_backend="torch")
    assert kernels.quantized and kernels.ops.kernels
    ids = [(7 * i + 3) % 500 + 5 for i in range(rows)]
    got, want = _prompt_logits(kernels, ids), _prompt_logits(reference, ids)
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    print(f"{layout.kind} rows={rows}: max relative logit error {rel.max().item():.4f}")
    assert rel.max().item() < LOGIT_TOLERANCE[layout.kind, rows], rel.max().item()


@pytest.mark.parametrize("layout", TINY_LAYOUTS, ids=lambda lay: lay.kind)
def test_a_decode_step_replays_from_a_cuda_graph(layout):
    from executor.kv_cache import KVCache

    model = quantized_model(random_model("tiny", device=DEVICE, dtype=torch.bfloat16), layout)
    kv = KVCache.for_model(model, num_blocks=4, block_size=16)
    prompt = [(7 * i + 3) % 500 + 5 for i in range(40)]
    model.forward(torch.tensor(prompt, device=DEVICE), _meta(len(prompt)), kv.k, kv.v)
    ids = torch.tensor([123], device=DEVICE)
    pos = torch.tensor([len(prompt)], device=DEVICE)
    meta = AttnMetadata(
        positions=pos,
        slot_mapping=pos,
        cu_q_lens=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([len(prompt) + 1], dtype=torch.int32, device=DEVICE),
        block_tables=torch.arange(4, dtype=torch.int32, device=DEVICE)[None],
        max_q_len=1,
    )

    def step() -> torch.Tensor:
        return model.logits(model.forward(ids, meta, kv.k, kv.v))  # [1, vocab]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = step()
    for token in (123, 77):
        ids.fill_(token)
        graph.replay()
        torch.testing.assert_close(static_logits, step(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["w4a16", "fp8"])
def test_the_engine_serves_each_layout_with_graphs(kind, monkeypatch):
    from hipfire_serve import LLM, SamplingParams, engine_setup
    from loadtests.lab.quant_child import LAYOUT_KINDS, install_layout

    monkeypatch.setattr(engine_setup, "random_model", engine_setup.random_model)  # restored after
    install_layout(Layout(LAYOUT_KINDS[kind], group_size=32, fp8_block=(32, 32)))
    llm = LLM(
        model="random:tiny",
        draft="none",
        spec_mode="ar",
        device="cuda",
        dtype="bfloat16",
        graphs="lazy",
        max_concurrency=4,
        kv_cache_memory="64MiB",
        max_model_len=256,
    )
    assert llm.engine.target.quantized
    prompts = [[(11 * i + j) % 500 + 5 for i in range(20 + 9 * j)] for j in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    for out in llm.generate(prompts, params):
        assert len(out.outputs[0].token_ids) == 24
        assert all(0 <= t < 512 for t in out.outputs[0].token_ids)
