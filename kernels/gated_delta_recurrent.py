"""The gated delta rule over a round's decode and verify rows, and the replay that commits them.

`gated_delta_rows`: one launch per layer, grid (sequences, value heads, Dv tiles). A program
loads its slice [Dk, BLOCK_V] of the sequence's state (fp32) once and runs the sequence's d rows
through the rule in order (d = 1 for an AR row, 1 + drafts for a SPEC group), per row t:
    q, k = l2norm(q_t) Dk^-0.5, l2norm(k_t)        fused: q, k arrive raw, one per key head
    S' = exp(g_t) S,  u_t = beta_t (v_t - S'^T k),  S = S' + k u_t^T,  o_t = S^T q
Each key head serves Hv / Hk consecutive value heads. A sequence whose journal start is < 0
(AR) writes its state back into its slot. A SPEC group leaves its slot untouched and writes a
compact journal per row instead of the state after it: (k, g_t, u_t), Hk Dk + Hv + Hv Dv floats
against Hv Dk Dv. The state after row j follows from the slot's by j + 1 rank-1 updates
S = exp(g_t) S + k u_t^T (u_t was computed from exactly that state), which `replay_journal`
applies at commit for all layers in one launch: the state is read and written once there.
Launch settings per GPU family are in `DELTA_TILES`; `*_ref` are the torch references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config

L2_EPS = 1e-6  # as the layer's reference l2norm: x * rsqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class DeltaTiles:
    """A GPU family's launch settings: Dv columns per program and its warps."""

    block_v: int = 32
    num_warps: int = 4


DELTA_TILES: dict[str, DeltaTiles] = {
    # A [128, 32] fp32 state tile is 32 registers per thread in 4 warps: room for the product
    # temporaries without spilling, and four tiles per head give small batches enough programs.
    "hopper": DeltaTiles(block_v=32, num_warps=4),
    "ampere_ada": DeltaTiles(block_v=32, num_warps=4),
    # wave64: the same tile in fewer, wider waves
    "cdna3": DeltaTiles(block_v=32, num_warps=2),
    "default": DeltaTiles(),
}


def delta_tiles(device: torch.device) -> DeltaTiles:
    return DELTA_TILES.get(arch_config(device).family, DELTA_TILES["default"])


@triton.jit
def _delta_rows_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr,
    seq_ptr, jk_ptr, jg_ptr, ju_ptr,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_gr, stride_br,
    stride_ss, stride_sh, stride_sk, stride_or, stride_oh,
    stride_jkr, stride_jkh, stride_jgr, stride_jur, stride_juh,
    num_seqs, scale, eps,
    HV_PER_K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_JOURNAL: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    hk = h // HV_PER_K
    # seq_ptr [4, n]: slot, first row, rows, journal start (-1: write the state back)
    slot = tl.load(seq_ptr + seq).to(tl.int64)
    start = tl.load(seq_ptr + num_seqs + seq).to(tl.int64)
    num_rows = tl.load(seq_ptr + 2 * num_seqs + seq).to(tl.int32)
    jstart = tl.load(seq_ptr + 3 * num_seqs + seq).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    s_ptrs = (
        state_ptr + slot * stride_ss + h * stride_sh
        + offs_k[:, None] * stride_sk + offs_v[None, :]
    )  # fmt: skip
    smask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    for t in range(num_rows):
        row = start + t
        q = tl.load(q_ptr + row * stride_qr + hk * stride_qh + offs_k, mask=mk, other=0.0)
        k = tl.load(k_ptr + row * stride_kr + hk * stride_kh + offs_k, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * stride_vr + h * stride_vh + offs_v, mask=mv, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + eps) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        g = tl.load(g_ptr + row * stride_gr + h).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_br + h).to(tl.float32)
        s = s * tl.exp(g)
        u = beta * (v.to(tl.float32) - tl.sum(s * k[:, None], 0))  # [BLOCK_V]
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], 0)  # [BLOCK_V]
        tl.store(out_ptr + row * stride_or + h * stride_oh + offs_v, o, mask=mv)
        if HAS_JOURNAL:  # noqa: SIM102 (a compile-time branch of its own)
            if jstart >= 0:
                jr = jstart + t
                tl.store(ju_ptr + jr * stride_jur + h * stride_juh + offs_v, u, mask=mv)
                if vt == 0:
                    tl.store(jg_ptr + jr * stride_jgr + h, g)
                    if h % HV_PER_K == 0:  # one writer per key head
                        tl.store(jk_ptr + jr * stride_jkr + hk * stride_jkh + offs_k, k, mask=mk)
    if jstart < 0:
        tl.store(s_ptrs, s, mask=smask)


@triton.jit
def _replay_kernel(
    state_ptr, seq_ptr, jk_ptr, jg_ptr, ju_ptr,
    stride_sl, stride_ss, stride_sh, stride_sk,
    stride_jkl, stride_jkr, stride_jkh, stride_jgl, stride_jgr, stride_jul, stride_jur,
    stride_juh, num_groups,
    HV: tl.constexpr, HV_PER_K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    grp = tl.program_id(0)
    lh = tl.program_id(1)
    vt = tl.program_id(2)
    layer = (lh // HV).to(tl.int64)
    h = lh % HV
    hk = h // HV_PER_K
    # seq_ptr [3, G]: slot, first journal row, rows to replay
    slot = tl.load(seq_ptr + grp).to(tl.int64)
    start = tl.load(seq_ptr + num_groups + grp).to(tl.int64)
    num_rows = tl.load(seq_ptr + 2 * num_groups + grp).to(tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    s_ptrs = (
        state_ptr + layer * stride_sl + slot * stride_ss + h * stride_sh
        + offs_k[:, None] * stride_sk + offs_v[None, :]
    )  # fmt: skip
    smask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    for t in range(num_rows):
        jr = start + t
        k = tl.load(jk_ptr + layer * stride_jkl + jr * stride_jkr + hk * stride_jkh + offs_k,
                    mask=mk, other=0.0)  # fmt: skip
        g = tl.load(jg_ptr + layer * stride_jgl + jr * stride_jgr + h)
        u = tl.load(ju_ptr + layer * stride_jul + jr * stride_jur + h * stride_juh + offs_v,
                    mask=mv, other=0.0)  # fmt: skip
        s = s * tl.exp(g)
        s = s + k[:, None] * u[None, :]
    tl.store(s_ptrs, s, mask=smask)


def _check_rows(q, k, v, g, beta, state, out, seqs):
    num_rows, hk, dk = q.shape  # [R, Hk, Dk]
    _, hv, dv = v.shape  # [R, Hv, Dv]
    assert k.shape == q.shape and v.shape[0] == num_rows and hv % hk == 0
    assert g.shape == (num_rows, hv) and beta.shape == (num_rows, hv)
    assert state.shape[1:] == (hv, dk, dv) and state.dtype == torch.float32
    assert out.shape == (num_rows, hv, dv) and out.dtype == torch.float32
    for x in (q, k, v, state, out):
        assert x.stride(-1) == 1, "last dims must be contiguous"
    assert g.stride(-1) == 1 and beta.stride(-1) == 1
    assert state.stride(2) == dv, "state rows must be contiguous [Dk, Dv] blocks"
    assert seqs.dim() == 2 and seqs.shape[0] == 4 and seqs.dtype == torch.int64
    assert seqs.is_contiguous()
    return hk, dk, hv, dv


def gated_delta_rows(
    q: torch.Tensor,  # [R, Hk, Dk] raw (before l2norm and scaling), any float dtype
    k: torch.Tensor,  # [R, Hk, Dk] raw
    v: torch.Tensor,  # [R, Hv, Dv]
    g: torch.Tensor,  # [R, Hv] fp32, <= 0
    beta: torch.Tensor,  # [R, Hv] fp32
    state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32 one layer's slots; AR sequences' updated
    out: torch.Tensor,  # [R, Hv, Dv] fp32, written at the sequences' rows
    seqs: torch.Tensor,  # [4, n] int64: slot, first row, rows, journal start (-1: none)
    journal: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Runs every sequence's rows through the rule (see the module doc). `journal`:
    (k [J, Hk, Dk], g [J, Hv], u [J, Hv, Dv]) fp32, written at the SPEC groups' rows."""
    hk, dk, hv, dv = _check_rows(q, k, v, g, beta, state, out, seqs)
    num_seqs = seqs.shape[1]
    if num_seqs == 0:
        return
    if journal is None:
        jk, jg, ju = out, g, out  # never written: no sequence has a journal start
        jk_strides, jg_stride, ju_strides = (0, 0), 0, (0, 0)
    else:
        jk, jg, ju = journal
        assert jk.shape[1:] == (hk, dk) and jg.shape[1:] == (hv,) and ju.shape[1:] == (hv, dv)
        assert all(x.dtype == torch.float32 and x.stride(-1) == 1 for x in journal)
        jk_strides, jg_stride, ju_strides = jk.stride()[:2], jg.stride(0), ju.stride()[:2]
    tiles = delta_tiles(q.device)
    block_v = min(tiles.block_v, triton.next_power_of_2(dv))
    grid = (num_seqs, hv, triton.cdiv(dv, block_v))
    _delta_rows_kernel[grid](
        q, k, v, g, beta, state, out, seqs, jk, jg, ju,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), state.stride(0), state.stride(1), state.stride(2),
        out.stride(0), out.stride(1), *jk_strides, jg_stride, *ju_strides,
        num_seqs, dk**-0.5, L2_EPS,
        HV_PER_K=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        HAS_JOURNAL=journal is not None, num_warps=tiles.num_warps,
    )  # fmt: skip


def replay_journal(
    state: torch.Tensor,  # [L, S, Hv, Dk, Dv] fp32 every layer's slots, updated
    groups: torch.Tensor,  # [3, G] int64: slot, first journal row, rows to replay
    jk: torch.Tensor,  # [L, J, Hk, Dk] fp32
    jg: torch.Tensor,  # [L, J, Hv]
    ju: torch.Tensor,  # [L, J, Hv, Dv]
) -> None:
    """Applies each group's first rows of the journal to its slot's state, in every layer."""
    num_layers, _, hv, dk, dv = state.shape
    hk = jk.shape[2]
    assert jk.shape[0] == jg.shape[0] == ju.shape[0] == num_layers and hv % hk == 0
    assert jk.shape[3] == dk and jg.shape[2] == hv and ju.shape[2:] == (hv, dv)
    assert state.dtype == torch.float32 and state.stride(-1) == 1 and state.stride(3) == dv
    assert all(x.dtype == torch.float32 and x.stride(-1) == 1 for x in (jk, jg, ju))
    assert groups.dim() == 2 and groups.shape[0] == 3 and groups.dtype == torch.int64
    assert groups.is_contiguous()
    num_groups = groups.shape[1]
    if num_groups == 0:
        return
    tiles = delta_tiles(state.device)
    block_v = min(tiles.block_v, triton.next_power_of_2(dv))
    grid = (num_groups, num_layers * hv, triton.cdiv(dv, block_v))
    _replay_kernel[grid](
        state, groups, jk, jg, ju,
        state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        jk.stride(0), jk.stride(1), jk.stride(2), jg.stride(0), jg.stride(1),
        ju.stride(0), ju.stride(1), ju.stride(2), num_groups,
        HV=hv, HV_PER_K=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v, num_warps=tiles.num_warps,
    )  # fmt: skip


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rows_ref(q, k, v, g, beta, state, out, seqs, journal=None) -> None:
    """`gated_delta_rows` in torch: one step of every sequence still running at a time (host
    loop over steps, the longest sequences first so the running ones are a prefix)."""
    hk, dk, hv, _ = _check_rows(q, k, v, g, beta, state, out, seqs)
    slots, starts, lens, jstarts = seqs.cpu().unbind(0)
    order = torch.argsort(-lens, stable=True)
    slots, starts, lens, jstarts = slots[order], starts[order], lens[order], jstarts[order]
    dev = state.device
    s = state.index_select(0, slots.to(dev))  # [n, Hv, Dk, Dv]
    per_k = hv // hk
    for t in range(int(lens.max()) if len(lens) else 0):
        n = int((lens > t).sum())
        rows = (starts[:n] + t).to(dev)
        qt = _l2norm(q[rows].float()) * dk**-0.5  # [n, Hk, Dk]
        kt = _l2norm(k[rows].float())
        gt, bt = g[rows].float(), beta[rows].float()  # [n, Hv]
        k_v = kt.repeat_interleave(per_k, dim=1)  # [n, Hv, Dk]
        st = s[:n]
        st.mul_(gt.exp()[..., None, None])
        u = (v[rows].float() - torch.einsum("nhk,nhkv->nhv", k_v, st)) * bt[..., None]
        st.add_(k_v[..., :, None] * u[..., None, :])
        out[rows] = torch.einsum("nhk,nhkv->nhv", qt.repeat_interleave(per_k, dim=1), st)
        js = jstarts[:n]
        if journal is not None and bool((js >= 0).any()):
            pos = torch.nonzero(js >= 0)[:, 0]
            jrows = (js[pos] + t).to(dev)
            pos = pos.to(dev)
            journal[0][jrows] = kt[pos]
            journal[1][jrows] = gt[pos]
            journal[2][jrows] = u[pos]
    kept = torch.nonzero(jstarts < 0)[:, 0]
    if len(kept):
        state.index_copy_(0, slots[kept].to(dev), s[kept.to(dev)])


def replay_journal_ref(state, groups, jk, jg, ju) -> None:
    """`replay_journal` in torch, in the kernel's order of operations."""
    hv, hk = state.shape[2], jk.shape[2]
    slots, starts, counts = groups.cpu().unbind(0)
    dev = state.device
    s = state.index_select(1, slots.to(dev))  # [L, G, Hv, Dk, Dv]
    for t in range(int(counts.max()) if len(counts) else 0):
        active = torch.nonzero(counts > t)[:, 0]
        rows = (starts[active] + t).to(dev)
        active = active.to(dev)
        k = jk[:, rows].repeat_interleave(hv // hk, dim=2)  # [L, a, Hv, Dk]
        decayed = s[:, active] * jg[:, rows].exp()[..., None, None]
        s[:, active] = decayed + k[..., :, None] * ju[:, rows][..., None, :]
    state.index_copy_(1, slots.to(dev), s)
