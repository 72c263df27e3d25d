"""The gated delta rule of Gated DeltaNet layers: a per-row recurrent step and a chunked form.

Per head, with a state S [Dk, Dv], for each row t (q, k l2-normed, q scaled by Dk^-0.5):
    S' = exp(g_t) S                          g_t <= 0: the decay, in log space
    u_t = beta_t (v_t - S'^T k_t)            what the state mispredicts for k_t (the delta)
    S = S' + k_t u_t^T                       o_t = S^T q_t
The chunked form runs C rows at once: with gamma_t the decay summed over the chunk up to t,
    (I + A) U = beta V - (beta exp(gamma) K) S_0,   A[t, s] = beta_t exp(gamma_t - gamma_s) k_t.k_s
over s < t (unit lower-triangular, one solve), then O = exp(gamma) Q S_0 + (QK^T * decay) U and
S_C = exp(gamma_C) S_0 + (exp(gamma_C - gamma) K)^T U. Everything is fp32. On a GPU with
flash-linear-attention importable, prefill chunks go to its chunked Triton kernel instead.
"""

from __future__ import annotations

import importlib.util

import torch

CHUNK_SIZE = 64


def recurrent_step(
    state: torch.Tensor,  # [n, H, Dk, Dv] fp32, updated in place
    q: torch.Tensor,  # [n, H, Dk] fp32
    k: torch.Tensor,  # [n, H, Dk]
    v: torch.Tensor,  # [n, H, Dv]
    g: torch.Tensor,  # [n, H]
    beta: torch.Tensor,  # [n, H]
) -> torch.Tensor:
    """One row of n sequences: updates `state` and returns o [n, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("nhk,nhkv->nhv", k, state)  # [n, H, Dv]
    delta = (v - predicted) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("nhk,nhkv->nhv", q, state)


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,  # [T, H, Dk] fp32
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] fp32: the state before row 0
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T rows in chunks: (o [T, H, Dv], the state after row T-1 [H, Dk, Dv])."""
    length, heads, _ = q.shape
    c = chunk_size
    pad = -length % c
    # padded rows have beta = 0 and k = 0, so they write nothing, and g = 0, so nothing decays

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, N, C, ...]
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x
        return x.reshape(-1, c, *x.shape[1:]).movedim(2, 0)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)  # [H, N, C, D]
    gc, bc = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [H, N, C]
    gamma = gc.cumsum(-1)  # [H, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # exp(gamma_t - gamma_s) for s <= t; masked first so exp never sees a positive exponent
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)  # [H, N, C, C]
    lower = a + torch.eye(c, dtype=a.dtype, device=a.device)
    w_v = torch.linalg.solve_triangular(lower, bc[..., None] * vc, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        lower, (bc * gamma.exp())[..., None] * kc, upper=False, unitriangular=True
    )  # U = w_v - w_k @ S_0
    attn = (qc @ kc.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_decayed = qc * gamma.exp()[..., None]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(vc)  # [H, N, C, Dv]
    s = state.clone()
    for n in range(qc.shape[1]):
        u = w_v[:, n] - w_k[:, n] @ s  # [H, C, Dv]
        out[:, n] = q_decayed[:, n] @ s + attn[:, n] @ u
        s = s * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ u
    out = out.movedim(0, 2).reshape(-1, heads, v.shape[-1])[:length]
    return out, s


def fla_available(device: torch.device) -> bool:
    """Whether flash-linear-attention's chunked kernel can run on `device`."""
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk] fp32, the rows of every sequence back to back
    k: torch.Tensor,
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    states: torch.Tensor,  # [N, H, Dk, Dv] fp32 before each sequence
    cu_lens: list[int],  # [N + 1] row offsets of the sequences
    kernel_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' rows in chunks: (o [T, H, Dv] fp32, the states after them [N, ...]).
    fla's kernel (bf16/fp16 inputs, `kernel_dtype`) where available, else the reference."""
    if kernel_dtype != torch.float32 and fla_available(q.device):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        o, final = fla_chunk(
            *(x.to(kernel_dtype)[None] for x in (q, k, v)),
            g[None],
            beta.to(kernel_dtype)[None],
            scale=1.0,  # q comes scaled
            initial_state=states,
            output_final_state=True,
            cu_seqlens=torch.tensor(cu_lens, dtype=torch.long, device=q.device),
        )
        return o[0].float(), final.float()
    outs, finals = [], []
    for i in range(len(cu_lens) - 1):
        a, b = cu_lens[i], cu_lens[i + 1]
        o, s = chunk_gated_delta_rule_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i])
        outs.append(o)
        finals.append(s)
    return torch.cat(outs), torch.stack(finals)
