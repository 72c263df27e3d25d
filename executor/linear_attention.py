"""A Gated DeltaNet layer (Qwen3.5's linear attention) over a round's ragged rows.

Per row: one GEMM gives the q|k|v conv inputs, the output gate z and the b, a heads; a causal
depthwise convolution of K taps (its first K-1 inputs from the slot's conv state) and SiLU;
q, k l2-normed per head (q also scaled by Dk^-0.5), beta = sigmoid(b), decay
g = -exp(A_log) softplus(a + dt_bias); the gated delta rule (`executor.delta_rule`) from the
slot's state; then a per-head RMSNorm gated by SiLU(z) and the output projection. Where each
sequence's state comes from and goes to is the round's `RoundStates`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.delta_rule import chunk_gated_delta_rule, recurrent_step
from executor.model_config import LinearAttnConfig
from executor.recurrent_state import RoundStates

L2_EPS = 1e-6


@dataclass(frozen=True)
class LinearAttnWeights:
    in_proj: torch.Tensor  # [conv_dim + value_dim + 2 Hv, hidden]: q k v | z | b | a
    conv: torch.Tensor  # [K, conv_dim]: tap 0 reads the oldest input
    neg_a: torch.Tensor  # [Hv] fp32: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] fp32
    norm: torch.Tensor  # [Dv] the gated RMSNorm's weight
    out_proj: torch.Tensor  # [hidden, value_dim]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def linear_attention(
    x: torch.Tensor,  # [R, hidden] the normed input rows
    w: LinearAttnWeights,
    cfg: LinearAttnConfig,
    eps: float,
    rs: RoundStates,
    layer: int,  # index among the linear layers
    linear,
) -> torch.Tensor:
    """The layer's output [R, hidden]; updates the kept sequences' state slots in place and
    writes the journaled groups' states after each row into the round's journal."""
    num_rows, dtype = x.shape[0], x.dtype
    hv, hk = cfg.num_value_heads, cfg.num_key_heads
    dk, dv = cfg.key_head_dim, cfg.value_head_dim
    mixed, z, b, a = linear(x, w.in_proj).split([cfg.conv_dim, cfg.value_dim, hv, hv], dim=-1)
    conv_state = rs.states.conv[layer]  # [S, K-1, C]
    src = torch.cat([mixed, conv_state.index_select(0, rs.slots).flatten(0, 1)])  # [R + m(K-1), C]
    windows = src[rs.conv_index]  # [R, K, C]
    conv = F.silu((windows.float() * w.conv.float()).sum(1).to(dtype))  # [R, C]
    if len(rs.kept_seqs):
        conv_state.index_copy_(0, rs.slots[rs.kept_seqs], src[rs.kept_index])
    if rs.conv_journal is not None:  # the state after row t is row t's window but its oldest
        rs.conv_journal[layer] = windows[rs.journal_rows, 1:]
    q, k, v = conv.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    q = _l2norm(q.reshape(num_rows, hk, dk)) * dk**-0.5
    k = _l2norm(k.reshape(num_rows, hk, dk))
    if hv != hk:  # each k head serves hv / hk consecutive v heads
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    v = v.reshape(num_rows, hv, dv)
    beta = b.sigmoid().float()  # [R, Hv]
    g = w.neg_a * F.softplus(a.float() + w.dt_bias)  # [R, Hv] <= 0
    core = torch.empty((num_rows, hv, dv), dtype=torch.float32, device=x.device)
    _recurrent_rows(rs, layer, core, q, k, v, g, beta)
    if rs.chunk_cu[-1]:
        ssm = rs.states.ssm[layer]
        rows = rs.chunk_rows
        out, final = chunk_gated_delta_rule(
            q[rows],
            k[rows],
            v[rows],
            g[rows],
            beta[rows],
            ssm.index_select(0, rs.chunk_slots),
            rs.chunk_cu,
            kernel_dtype=dtype,
        )
        core[rows] = out
        ssm.index_copy_(0, rs.chunk_slots, final)
    h = core.to(dtype).float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gated = (w.norm * h) * F.silu(z.reshape(num_rows, hv, dv).float())
    return linear(gated.to(dtype).reshape(num_rows, cfg.value_dim), w.out_proj)


def _recurrent_rows(rs: RoundStates, layer: int, core, q, k, v, g, beta) -> None:
    """AR rows and SPEC groups, one step of every such sequence at a time (longest first, so
    the sequences still running at step t are a prefix)."""
    if not rs.step_rows:
        return
    ssm = rs.states.ssm[layer]
    state = ssm.index_select(0, rs.rec_slots)  # [r, H, Dk, Dv]
    for rows, journal in zip(rs.step_rows, rs.step_journal):
        core[rows] = recurrent_step(
            state[: len(rows)], q[rows], k[rows], v[rows], g[rows], beta[rows]
        )
        if journal is not None:
            pos, at = journal
            rs.ssm_journal[layer].index_copy_(0, at, state.index_select(0, pos))
    if len(rs.rec_kept):
        ssm.index_copy_(0, rs.rec_slots[rs.rec_kept], state.index_select(0, rs.rec_kept))
