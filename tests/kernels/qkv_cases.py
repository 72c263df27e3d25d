"""Random inputs of the fused q/k norm + RoPE + KV store kernel and the check of one case against
its torch reference; shared by the interpreter tests and the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.model_config import RopeConfig
from executor.rope import build_cos_sin_cache
from kernels.fused_qk import qk_norm_rope_and_write_kv, qk_norm_rope_and_write_kv_ref
from tests.kernels.paged import rel_err


@dataclass(frozen=True)
class QkvCase:
    num_rows: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    is_neox: bool
    qk_norm: bool
    dtype: torch.dtype
    device: str
    seed: int = 0
    page_size: int = 16
    padded_every: int = 3  # every n-th row is padding (slot -1); 0: none


def build_inputs(case: QkvCase) -> dict:
    """qkv is a column slice of a wider buffer (rows strided, as a bias-free GEMM output can be
    viewed); slots are scattered over a cache with spare blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    n, d = case.num_rows, case.head_dim
    width = (case.num_q_heads + 2 * case.num_kv_heads) * d

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype).to(case.device)

    qkv = rand(n, width + 2 * d)[:, d : d + width]  # [N, width], row stride width + 2d
    num_blocks = -(-n // case.page_size) + 3
    max_pos = 4 * n + 64
    slots = torch.randperm(num_blocks * case.page_size, generator=gen)[:n]
    if case.padded_every:
        slots[:: case.padded_every] = -1
    # padded rows get positions past the table: the kernel must not read them
    positions = torch.where(slots >= 0, torch.randint(0, max_pos, (n,), generator=gen), 10**9)
    return dict(
        qkv=qkv,
        q_norm=rand(d) if case.qk_norm else None,
        k_norm=rand(d) if case.qk_norm else None,
        eps=1e-6,
        positions=positions.to(case.device),
        cos_sin_cache=build_cos_sin_cache(case.rope, d, max_pos, case.device),
        slot_mapping=slots.to(case.device),
        k_cache=rand(num_blocks, case.page_size, case.num_kv_heads, d),
        v_cache=rand(num_blocks, case.page_size, case.num_kv_heads, d),
    )


def run_both(case: QkvCase) -> tuple[dict, dict, dict]:
    """Returns (inputs before, kernel results, reference results); results hold q, k_cache,
    v_cache and qkv (to check it is left unchanged)."""
    inputs = build_inputs(case)
    results = []
    for fn in (qk_norm_rope_and_write_kv, qk_norm_rope_and_write_kv_ref):
        args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        q = fn(**args, num_q_heads=case.num_q_heads, is_neox=case.is_neox)
        results.append(dict(q=q, k_cache=args["k_cache"], v_cache=args["v_cache"], qkv=args["qkv"]))
    return inputs, results[0], results[1]


def check_case(case: QkvCase, rel_tol: float) -> None:
    """Kernel against reference: q and the written cache slots within `rel_tol` of the largest
    reference magnitude, v copied exactly, untouched slots and qkv bit-identical."""
    inputs, got, want = run_both(case)
    assert got["q"].shape == (case.num_rows, case.num_q_heads, case.head_dim)
    assert got["q"].is_contiguous() and got["q"].dtype == case.dtype
    assert torch.equal(got["qkv"], inputs["qkv"])  # read only
    assert torch.equal(got["v_cache"], want["v_cache"])  # a copy: exact
    for name in ("q", "k_cache"):
        err = (got[name].float() - want[name].float()).abs().max()
        assert err <= rel_tol * want[name].float().abs().max(), (name, float(err))
    slots = inputs["slot_mapping"]
    real = slots[slots >= 0]
    written = torch.zeros(inputs["k_cache"].shape[:2], dtype=torch.bool, device=slots.device)
    written.view(-1)[real] = True
    for name in ("k_cache", "v_cache"):  # only the real rows' slots changed
        assert torch.equal(got[name][~written], inputs[name][~written])
    assert got["q"].isfinite().all()


def check_against_fp32(case: QkvCase, rel_tol: float) -> None:
    """Kernel in case.dtype against the reference run in fp32 on the same (rounded) inputs:
    relative L2 error of q and of the written k/v slots below `rel_tol`."""
    inputs = build_inputs(case)
    wide = {
        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }
    q = qk_norm_rope_and_write_kv(**inputs, num_q_heads=case.num_q_heads, is_neox=case.is_neox)
    q32 = qk_norm_rope_and_write_kv_ref(**wide, num_q_heads=case.num_q_heads, is_neox=case.is_neox)
    real = inputs["slot_mapping"] >= 0
    slots = inputs["slot_mapping"][real]
    assert rel_err(q[real], q32[real]) < rel_tol
    for name in ("k_cache", "v_cache"):
        got = inputs[name].flatten(0, 1)[slots]  # [n, Hkv, D]
        want = wide[name].flatten(0, 1)[slots]
        assert rel_err(got, want) < rel_tol, name
