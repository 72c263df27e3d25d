"""SiLU-and-mul as the skinny linear's input prologue, in Triton's interpreter on the CPU (small
shapes, fp16/fp32): the fused launch gives the same bits as silu_and_mul followed by the
skinny linear with the same config, and `silu_mul_linear` takes it exactly where `linear` would
take the skinny kernel, fusion is on and the rows are within FUSED_MAX_ROWS."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import ops as executor_ops
from executor.model import AttnMetadata
from executor.random_model import PRESETS
from kernels import skinny_linear as sl
from kernels.norms import silu_and_mul, silu_and_mul_ref
from kernels.skinny_linear import (
    MAX_ROWS,
    TUNED,
    SkinnyConfig,
    fused_prologue_forced,
    silu_mul_linear,
    silu_mul_skinny_linear,
    skinny_linear,
)
from tests.kernels.models import random_norms_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = (
    SkinnyConfig(16, 32, 1, 4, 2, True),  # unsplit dot tiles
    SkinnyConfig(16, 32, 3, 4, 2, True),  # split-K, the last split reduces
    SkinnyConfig(16, 32, 3, 4, 2, True, False),  # split-K, the second kernel reduces
    SkinnyConfig(16, 32, 2, 4, 2, False),  # fp32 multiply-add tiles, split
)


def _inputs(num_rows: int, n: int, inter: int, dtype: torch.dtype, seed: int, with_bias: bool):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up = (torch.randn((num_rows, 2 * inter), generator=gen, device=DEVICE) * 3).to(dtype)
    w = (torch.randn((n, inter), generator=gen, device=DEVICE) * 0.1).to(dtype)  # [N, I]
    bias = torch.randn((n,), generator=gen, device=DEVICE).to(dtype) if with_bias else None
    return gate_up, w, bias


def _unfused(gate_up, w, bias, cfg):
    return skinny_linear(silu_and_mul(gate_up), w, bias, cfg)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("num_rows", [1, 3, 16])
def test_fused_equals_silu_and_mul_then_linear(cfg, dtype, num_rows):
    """Bit for bit, with an odd K tail (I = 99) and a ragged N; and near the fp32 product of
    the torch reference."""
    if not cfg.use_dot:
        num_rows = min(num_rows, 4)  # multiply-add tiles hold every row in registers
    gate_up, w, bias = _inputs(num_rows, 40, 99, dtype, seed=num_rows, with_bias=True)
    fused = silu_mul_skinny_linear(gate_up, w, bias, cfg)
    assert torch.equal(fused, _unfused(gate_up, w, bias, cfg))
    ref = torch.nn.functional.linear(silu_and_mul_ref(gate_up).float(), w.float(), bias.float())
    assert (fused.float() - ref).abs().max() <= 2e-2 * max(1.0, ref.abs().max().item())


@settings(max_examples=12, deadline=None)
@given(
    num_rows=st.integers(1, MAX_ROWS),
    n_extra=st.integers(0, 15),
    inter=st.integers(16, 130),
    split_k=st.integers(1, 4),
    last_reduces=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_rows_tail_and_split(num_rows, n_extra, inter, split_k, last_reduces, seed):
    cfg = SkinnyConfig(16, 32, split_k, 4, 2, True, last_reduces)
    gate_up, w, bias = _inputs(num_rows, 16 + n_extra, inter, torch.float32, seed, seed % 2 == 0)
    for _ in range(2):  # the second launch reuses the tile counters
        fused = silu_mul_skinny_linear(gate_up, w, bias, cfg)
        assert torch.equal(fused, _unfused(gate_up, w, bias, cfg))


def test_rejects_a_gate_up_of_the_wrong_width():
    gate_up, w, _ = _inputs(2, 16, 32, torch.float16, seed=1, with_bias=False)
    with pytest.raises(AssertionError):
        silu_mul_skinny_linear(gate_up[:, :48], w)
    with pytest.raises(AssertionError):
        silu_mul_skinny_linear(gate_up.float(), w)  # dtype mismatch


@pytest.fixture
def launches(monkeypatch):
    """Records which wrapper each `silu_mul_linear` call ends in: "fused" or "linear"."""
    calls: list[str] = []
    fused, plain = sl.silu_mul_skinny_linear, sl.skinny_linear
    monkeypatch.setattr(sl, "silu_mul_skinny_linear", lambda *a: calls.append("fused") or fused(*a))
    monkeypatch.setattr(sl, "skinny_linear", lambda *a: calls.append("linear") or plain(*a))
    return calls


def test_dispatch_follows_the_skinny_path_the_switch_and_the_row_limit(monkeypatch, launches):
    cfg = SkinnyConfig(16, 32, 2, 4, 2, True)
    for bucket in (1, 2, 4, 8, 16):
        monkeypatch.setitem(TUNED, (32, 48, bucket), cfg)
    gate_up, w, bias = _inputs(16, 32, 48, torch.float16, seed=2, with_bias=True)
    want = _unfused(gate_up, w, bias, cfg)
    assert torch.equal(silu_mul_linear(gate_up, w, bias), want)
    assert launches == ["fused"]
    launches.clear()
    with fused_prologue_forced(False):  # off: the two ops of the unfused layer
        assert torch.equal(silu_mul_linear(gate_up, w, bias), want)
    assert launches == ["linear"]
    launches.clear()
    monkeypatch.setattr(sl, "FUSED_MAX_ROWS", 4)
    assert torch.equal(silu_mul_linear(gate_up[:4], w, bias), _unfused(gate_up[:4], w, bias, cfg))
    assert torch.equal(silu_mul_linear(gate_up[:5], w, bias), _unfused(gate_up[:5], w, bias, cfg))
    assert launches == ["fused", "linear"]
    launches.clear()
    # shapes without a tuned config and more than 16 rows stay on torch, unfused
    gate_up17, w17, _ = _inputs(17, 32, 48, torch.float16, seed=3, with_bias=False)
    ref17 = torch.nn.functional.linear(silu_and_mul(gate_up17), w17)
    assert torch.equal(silu_mul_linear(gate_up17, w17), ref17)
    other, w_other, _ = _inputs(4, 24, 48, torch.float16, seed=4, with_bias=False)
    assert torch.equal(
        silu_mul_linear(other, w_other), torch.nn.functional.linear(silu_and_mul(other), w_other)
    )
    assert launches == []


def test_the_environment_switch_is_read_once(monkeypatch):
    sl._fused_env_allows.cache_clear()
    try:
        monkeypatch.setenv(sl.FUSED_PROLOGUE_ENV, "0")
        assert not sl.fused_prologue_enabled() and not executor_ops.fused_prologue_enabled()
        monkeypatch.setenv(sl.FUSED_PROLOGUE_ENV, "1")
        assert not sl.fused_prologue_enabled()  # decided once per process
        with executor_ops.fused_prologue_forced(True):
            assert sl.fused_prologue_enabled()
        assert not sl.fused_prologue_enabled()
    finally:
        sl._fused_env_allows.cache_clear()
    monkeypatch.delenv(sl.FUSED_PROLOGUE_ENV)
    assert sl.fused_prologue_enabled()  # on by default


def test_reference_op_is_silu_and_mul_then_f_linear():
    gate_up, w, bias = _inputs(3, 16, 24, torch.float32, seed=5, with_bias=True)
    ref = executor_ops.reference_ops().silu_mul_linear(gate_up, w, bias)
    assert torch.equal(ref, torch.nn.functional.linear(silu_and_mul_ref(gate_up), w, bias))


def test_forward_with_fusion_on_equals_fusion_off(monkeypatch, launches):
    """A tiny Qwen3 forward on the Triton path with every projection on the skinny kernel (fp16
    configs of the tiny shapes): the logits of the fused forward are those of the unfused one."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=1)
    model = random_norms_model(cfg, torch.device(DEVICE), torch.float16, max_position=64)
    model.ops, model.route_linear_through_ops = executor_ops.triton_ops(), True
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    for n, k in ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i), (cfg.vocab_size, h)):
        for bucket in (1, 2, 4):
            monkeypatch.setitem(TUNED, (n, k, bucket), SkinnyConfig(16, 32, 2, 4, 2, True))
    block = 4
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([5, 6, 2], device=DEVICE)
    slots = torch.tensor([1 * block + 1, 1 * block + 2, 0 * block + 2], device=DEVICE)
    meta = AttnMetadata(
        positions=positions,
        slot_mapping=slots,
        cu_q_lens=torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([7, 3], dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_q_len=2,
    )
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    shape = (4, block, cfg.num_kv_heads, cfg.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).half()
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).half()
    ids = torch.tensor([7, 8, 9], device=DEVICE)
    logits = {}
    for fused in (False, True):
        with fused_prologue_forced(fused):
            hidden = model.forward(ids, meta, [k_cache.clone()], [v_cache.clone()])
            logits[fused] = model.logits(hidden)
    assert launches.count("fused") == 1  # the one layer's down projection
    assert torch.equal(logits[True], logits[False]) and logits[True].isfinite().all()
