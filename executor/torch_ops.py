"""Pure-torch versions of the model's device operations (the CPU path and the kernels'
reference semantics). Layouts match `kernels/`: KV cache `[num_blocks, block_size, kv_heads, D]`.
"""

from __future__ import annotations

import torch


def rms_norm(x, weight, eps, residual=None):
    """x [n, h]; with `residual`: h = x + residual, returns (norm(h), h). Computed in fp32 and
    cast back before the weight multiply, as the HF models do."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, x)


def head_rms_norm(x, weight, eps):
    """x [n, heads, d], weight [d]: RMSNorm over each head (Qwen3 q/k norm)."""
    return rms_norm(x, weight, eps)


def silu_and_mul(x):
    """x [n, 2i] -> [n, i]: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate(x, cos, sin, rot_dim):
    # neox layout: dims i and i + rot_dim/2 form a pair
    half = rot_dim // 2
    xr = x[..., :rot_dim].float()
    x1, x2 = xr[..., :half], xr[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rot_dim == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rot_dim:]], dim=-1)


def rope_and_write_kv(
    q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, *, is_neox=True
):
    """In place: rotates q [n, hq, d] and k [n, hkv, d] at `positions` [n]; stores k, v at
    `slot_mapping` [n] (block * block_size + offset; < 0 skipped)."""
    if not is_neox:
        raise NotImplementedError("interleaved rope is served by the Triton kernel only")
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [n, rot_dim/2] each
    q.copy_(_rotate(q, cos[:, None, :], sin[:, None, :], rot_dim))
    k.copy_(_rotate(k, cos[:, None, :], sin[:, None, :], rot_dim))
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[valid].to(v_cache.dtype)


def verify_attention(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables, scale, out=None):
    """Ragged causal attention over paged KV. q [rows, hq, d]; sequence s owns rows
    cu_q_lens[s]:cu_q_lens[s+1], sitting at the last q_len positions of its seq_lens[s] tokens."""
    _, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(q)
    cu = cu_q_lens.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[s, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, hkv, d]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [hq, seq_len, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        qs = q[start:end].transpose(0, 1).float()  # [hq, q_len, d]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq]
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    return out
