"""A Gated DeltaNet layer (Qwen3.5's linear attention) over a round's ragged rows.

Per row: one GEMM gives the q|k|v conv inputs, the output gate z and the b, a heads; a causal
depthwise convolution of K taps (its first K-1 inputs from the slot's conv state) and SiLU;
q, k l2-normed per head (q also scaled by Dk^-0.5), beta = sigmoid(b), decay
g = -exp(A_log) softplus(a + dt_bias); the gated delta rule from the slot's state (decode and
verify rows: `kernels.gated_delta_recurrent`, which l2-norms q and k itself; prefill chunks:
`executor.delta_rule`); then a per-head RMSNorm gated by SiLU(z) and the output projection.
Where each sequence's state comes from and goes to is the round's `RoundStates`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.delta_rule import chunk_gated_delta_rule
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
    writes the journaled groups' rows into the round's compact journal."""
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
    if rs.conv_journal is not None:  # a SPEC row's conv input: commit rebuilds the state
        rs.conv_journal[layer] = mixed[rs.journal_rows]
    # in the model dtype, raw (not yet l2-normed): the kernel reads them so, in fp32
    q, k, v = conv.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    q, k = q.reshape(num_rows, hk, dk), k.reshape(num_rows, hk, dk)
    v = v.reshape(num_rows, hv, dv)
    beta = b.sigmoid().float()  # [R, Hv]
    g = w.neg_a * F.softplus(a.float() + w.dt_bias)  # [R, Hv] <= 0
    core = torch.empty((num_rows, hv, dv), dtype=torch.float32, device=x.device)
    ssm = rs.states.ssm[layer]
    if rs.rec_seqs.shape[1]:  # AR rows and SPEC groups: one fused launch (l2norm inside)
        rs.states.delta_rows(q, k, v, g, beta, ssm, core, rs.rec_seqs, rs.delta_journal(layer))
    if rs.chunk_cu[-1]:
        rows = rs.chunk_rows
        qc = _l2norm(q[rows].float()) * dk**-0.5
        kc = _l2norm(k[rows].float())
        if hv != hk:  # each k head serves hv / hk consecutive v heads
            qc, kc = qc.repeat_interleave(hv // hk, dim=1), kc.repeat_interleave(hv // hk, dim=1)
        out, final = chunk_gated_delta_rule(
            qc,
            kc,
            v[rows].float(),
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
