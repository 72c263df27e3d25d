"""The fused q/k norm + RoPE + KV store kernel against its torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.model_config import RopeConfig
from kernels.fused_qk import qk_norm_rope_and_write_kv, qk_norm_rope_and_write_kv_ref
from kernels.norms import head_rms_norm_ref
from tests.kernels.qkv_cases import QkvCase, build_inputs, check_against_fp32, check_case

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, rope_type="linear", factor=4.0),
    "llama3": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=64),
    "yarn": RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position=64),
    "partial": RopeConfig(theta=10000.0, rotary_dim=16),
}


@settings(max_examples=12)
@given(
    num_rows=st.integers(1, 9),
    # GQA, MHA, MQA, and head counts that leave a part-empty block of heads (3 -> 4 per program,
    # 10 kv heads -> two programs of 8)
    heads=st.sampled_from([(6, 2), (4, 4), (8, 1), (9, 3), (20, 10)]),
    head_dim=st.sampled_from([32, 48]),
    rope=st.sampled_from(sorted(ROPES)),
    is_neox=st.booleans(),
    qk_norm=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_fused_qk_matches_reference(num_rows, heads, head_dim, rope, is_neox, qk_norm, dtype, seed):
    case = QkvCase(
        num_rows=num_rows,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        rope=ROPES[rope],
        is_neox=is_neox,
        qk_norm=qk_norm,
        dtype=dtype,
        device=DEV,
        seed=seed,
        page_size=4,
        padded_every=seed % 4,
    )
    check_case(case, TOL[dtype])
    check_against_fp32(case, 10 * TOL[dtype])


def _case(**kw) -> QkvCase:
    base = dict(
        num_rows=3, num_q_heads=4, num_kv_heads=2, head_dim=16, rope=ROPES["default"],
        is_neox=True, qk_norm=True, dtype=torch.float32, device=DEV, page_size=4,
    )  # fmt: skip
    return QkvCase(**{**base, **kw})


def test_padded_row_q_is_normed_not_rotated_and_no_slot_written():
    case = _case(padded_every=2)  # rows 0 and 2 padded, row 1 real
    inputs = build_inputs(case)
    # a table whose row 0 is no identity either (as with yarn's attention factor)
    inputs["cos_sin_cache"] = torch.randn(inputs["cos_sin_cache"].shape, device=DEV)
    k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    q = qk_norm_rope_and_write_kv(**inputs, num_q_heads=4, is_neox=True)
    q_raw = inputs["qkv"][:, : 4 * 16].reshape(3, 4, 16)
    normed = head_rms_norm_ref(q_raw, inputs["q_norm"], 1e-6)  # [3, 4, 16]
    for row in (0, 2):
        assert (q[row] - normed[row]).abs().max() < 1e-6
    assert (q[1] - normed[1]).abs().max() > 1e-2  # the real row is rotated
    slot = int(inputs["slot_mapping"][1])
    changed = (inputs["k_cache"] != k_cache).flatten(2).any(-1).nonzero().tolist()
    assert changed == [[slot // 4, slot % 4]]
    assert (inputs["v_cache"] != v_cache).flatten(2).any(-1).nonzero().tolist() == changed


@pytest.mark.parametrize("qk_norm", [True, False])
def test_styles_differ_and_norm_switch_changes_q(qk_norm):
    outs = {}
    for is_neox in (True, False):
        inputs = build_inputs(_case(qk_norm=qk_norm, padded_every=0))
        outs[is_neox] = qk_norm_rope_and_write_kv(**inputs, num_q_heads=4, is_neox=is_neox)
    assert not torch.allclose(outs[True], outs[False])
    inputs = build_inputs(_case(qk_norm=qk_norm, padded_every=0))
    raw = inputs["qkv"][:, : 4 * 16].reshape(3, 4, 16)
    heads = head_rms_norm_ref(raw, inputs["q_norm"], 1e-6) if qk_norm else raw
    rms = outs[True].float().pow(2).mean(-1).sqrt()  # rotation keeps a head's length
    want = heads.float().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, want, rtol=1e-4)


def test_zero_rows_and_reference_leaves_qkv_alone():
    inputs = build_inputs(_case(num_rows=1))
    empty = {
        k: (v[:0] if k in ("qkv", "positions", "slot_mapping") else v) for k, v in inputs.items()
    }
    assert qk_norm_rope_and_write_kv(**empty, num_q_heads=4, is_neox=True).shape == (0, 4, 16)
    before = inputs["qkv"].clone()
    qk_norm_rope_and_write_kv_ref(**inputs, num_q_heads=4, is_neox=True)
    assert torch.equal(inputs["qkv"], before)


def test_rejects_mismatched_layouts():
    inputs = build_inputs(_case())
    with pytest.raises(AssertionError, match="qkv width"):
        qk_norm_rope_and_write_kv(**inputs, num_q_heads=5, is_neox=True)
    with pytest.raises(AssertionError, match="come together"):
        qk_norm_rope_and_write_kv(**{**inputs, "k_norm": None}, num_q_heads=4, is_neox=True)
