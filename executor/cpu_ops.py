"""The model's operations on a CPU: the kernels' torch references with their per-forward work
done once per forward instead of once per layer.

On a CPU every torch call costs microseconds of dispatch, and a decode round of a small model is
made of little else. What the references recompute in every layer depends only on the round's
rows (which rows store K/V, their RoPE angles, where each sequence's KV lives in the paged cache,
the causal mask), so `ForwardPlan` computes it at its first use in a forward and every layer
reads it. The arithmetic is the references' own, op for op on the same operands (the KV gather
and the query-group repeat are one index instead of two copies, which moves the same values), so
results are bitwise those of `kernels.*_ref`; `tests/executor/test_cpu_ops.py` holds them to it.
An FP8 cache is stored and read by the references' own rule (`kernels.kv_fp8`), with the bytes
moved through uint8 views where torch's CPU ops have no float8 kernel (index_copy_).

Linear layers (`linear`) are the one place that departs from the references' operands: a wide
weight (at least `WIDE` times more outputs than inputs: gate/up, the LM head) is multiplied as
the CPU BLAS streams it fastest at the round's row count. One row, or more than `FEW_ROWS`:
x @ W^T against a copy stored [K, N] (made at its first use, held while the weight lives); 2 to
`FEW_ROWS` rows: W @ x^T on the weight as it is, transposed back. On the demo model's LM head
(8192 x 384, fp32, one thread) that took 636 us at one row and 1,039 at four, against 1,525 and
2,155 for F.linear (`docs/perf/cpu-host-cost.md`). Other weights are fastest through F.linear.
The products are F.linear's up to rounding (a different summation order).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention import verify_attention_ref
from kernels.fused_qk import qk_norm_rope_and_write_kv_ref
from kernels.kv_fp8 import check_kv_scales, is_fp8, kv_store_ref
from kernels.norms import rms_norm_ref, silu_and_mul_ref

# the attribute of a weight holding (its version when copied, the copy [K, N]): the copy lives
# and goes with the weight
_TRANSPOSED = "_hipfire_cpu_transposed"
WIDE = 4  # outputs per input from which a weight is wide
FEW_ROWS = 8  # rows up to which W @ x^T beats both other forms on a wide weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias) for a dense weight [N, K], a wide one multiplied in the form
    its row count runs fastest in (see the module doc)."""
    n, k = weight.shape
    if n < WIDE * k or weight.requires_grad:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if 2 <= rows <= FEW_ROWS:
        out = torch.mm(weight, flat.t()).t().contiguous()  # [rows, N]
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], n)
    held = getattr(weight, _TRANSPOSED, None)
    if held is None or held[0] != weight._version:
        held = (weight._version, weight.t().contiguous())
        setattr(weight, _TRANSPOSED, held)
    out = torch.mm(flat, held[1]) if bias is None else torch.addmm(bias, flat, held[1])
    return out.reshape(*x.shape[:-1], n)


class ForwardPlan:
    """What every layer of one forward shares: the rows that store K/V and their cos/sin, and
    per sequence its rows, KV length, the flat cache rows of its keys repeated per query head
    and its causal mask. Built lazily from host tensors, as the references read them."""

    def __init__(
        self,
        positions: torch.Tensor,  # [N] int64
        slot_mapping: torch.Tensor,  # [N] int64, < 0: a padded row
        cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim]
        meta=None,  # AttnMetadata of the forward (None: no attention, a context write)
        causal: bool = True,
    ):
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.cos_sin_cache = cos_sin_cache
        self.meta, self.causal = meta, causal
        self._rows: tuple | None = None
        self._seqs: dict[tuple[int, int, int], list] = {}

    def rows(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kept rows, None when all are; cos [n, 1, half]; sin [n, 1, half]; their slots)."""
        if self._rows is None:
            slot_mapping = self.slot_mapping
            keep = slot_mapping >= 0  # [N]
            rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
            positions = self.positions if rows is None else self.positions[rows]
            slots = slot_mapping if rows is None else slot_mapping[rows]
            half = self.cos_sin_cache.shape[1] // 2
            cs = self.cos_sin_cache[positions].float()  # [n, rot_dim]
            self._rows = (rows, cs[:, None, :half], cs[:, None, half:], slots)
        return self._rows

    def seqs(self, page_size: int, num_q_heads: int, num_kv_heads: int) -> list:
        """Per non-empty sequence (q_start, q_end, kv_index [L * Hq] into the cache viewed as
        [blocks * page * Hkv, D], kv_len, mask [1, q_len, L] or None); the last entry is the
        rows the sequences cover."""
        key = (page_size, num_q_heads, num_kv_heads)
        seqs = self._seqs.get(key)
        if seqs is None:
            seqs = self._seqs[key] = self._build_seqs(page_size, num_q_heads, num_kv_heads)
        return seqs

    def _build_seqs(self, page_size: int, num_q_heads: int, num_kv_heads: int) -> list:
        meta = self.meta
        cu = meta.cu_q_lens.tolist()
        lens = meta.seq_lens.tolist()
        tables = meta.block_tables.numpy()
        # query head h reads kv head h // group, as repeat_interleave(group) lays them out
        head_of = np.arange(num_q_heads) // (num_q_heads // num_kv_heads)  # [Hq]
        in_page = np.arange(page_size)
        out = []
        for seq in range(len(cu) - 1):
            q_start, q_end, kv_len = cu[seq], cu[seq + 1], lens[seq]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            pages = tables[seq, : -(-kv_len // page_size)].astype(np.int64)
            slots = (pages[:, None] * page_size + in_page).reshape(-1)[:kv_len]  # [L]
            index = (slots[:, None] * num_kv_heads + head_of).reshape(-1)  # [L * Hq]
            mask = None
            # a single row sits at the last position: no key is after it
            if self.causal and q_len > 1:
                q_pos = torch.arange(kv_len - q_len, kv_len)
                k_pos = torch.arange(kv_len)
                mask = k_pos[None, None, :] > q_pos[None, :, None]  # [1, q_len, L]
            out.append((q_start, q_end, torch.from_numpy(index), kv_len, mask))
        out.append(cu[-1])
        return out


def forward_plan(positions, slot_mapping, cos_sin_cache, meta=None, causal=True) -> ForwardPlan:
    return ForwardPlan(positions, slot_mapping, cos_sin_cache, meta, causal)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref` without its dtype round trips, which are no-ops in float32."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return rms_norm_ref(x, weight, eps, residual)
    h = x if residual is None else x + residual
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
    out = (h * rstd).mul_(weight)
    return out if residual is None else (out, h)


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`head_rms_norm_ref`: RMSNorm over head_dim of every head of x [N, H, D]."""
    return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).reshape(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        return silu_and_mul_ref(x)
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]


def qk_norm_rope_and_write_kv(
    qkv: torch.Tensor,  # [N, (Hq + 2 Hkv) * D]
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,  # [blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    *,
    num_q_heads: int,
    is_neox: bool,
    plan: ForwardPlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qk_norm_rope_and_write_kv_ref`: returns q [N, Hq, D] contiguous, stores k and v. q and
    k are rotated together (one set of element-wise ops over their heads side by side)."""
    num_rows, width = qkv.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if (
        not is_neox
        or qkv.stride(1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or width != (num_q_heads + 2 * num_kv_heads) * head_dim
        or k_cache.dtype != v_cache.dtype
        or not (k_cache.dtype == qkv.dtype or is_fp8(k_cache.dtype))
        or positions.shape != (num_rows,)
        or slot_mapping.shape != (num_rows,)
    ):  # the reference asserts the layout and handles every rotation
        return qk_norm_rope_and_write_kv_ref(
            qkv, q_norm, k_norm, eps, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
            num_q_heads=num_q_heads, is_neox=is_neox, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    check_kv_scales(k_cache, k_scale, v_scale)
    if plan is None:
        plan = ForwardPlan(positions, slot_mapping, cos_sin_cache)
    heads = num_q_heads + num_kv_heads
    q_size = num_q_heads * head_dim
    qk_view = qkv[:, : heads * head_dim].view(num_rows, heads, head_dim)  # [N, Hq + Hkv, D]
    if q_norm is not None:
        qk = torch.empty((num_rows, heads, head_dim), dtype=qkv.dtype)
        if num_q_heads:
            qk[:, :num_q_heads] = _head_rms_norm(qk_view[:, :num_q_heads], q_norm, eps)
        qk[:, num_q_heads:] = _head_rms_norm(qk_view[:, num_q_heads:], k_norm, eps)
    else:
        qk = qk_view.clone()  # [N, Hq + Hkv, D] contiguous, rotated in place below
    v = qkv[:, q_size + num_kv_heads * head_dim :].view(num_rows, num_kv_heads, head_dim)
    rows, cos, sin, slots = plan.rows()
    if slots.numel():
        x = qk if rows is None else qk[rows]  # [n, Hq + Hkv, D]
        half = cos.shape[-1]
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        out1 = (x1 * cos - x2 * sin).to(x.dtype)
        out2 = (x2 * cos + x1 * sin).to(x.dtype)
        x[..., :half], x[..., half : 2 * half] = out1, out2
        if rows is not None:
            qk[rows] = x
        # index_copy_ stores the same rows as the reference's indexed assignment, in one call
        k_new = kv_store_ref(x[:, num_q_heads:], k_scale, k_cache.dtype)  # [n, Hkv, D]
        v_new = kv_store_ref(v if rows is None else v[rows], v_scale, v_cache.dtype)
        _store_rows(k_cache, slots, k_new)
        _store_rows(v_cache, slots, v_new)
    return qk[:, :num_q_heads].contiguous()


def _store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [blocks, page, Hkv, D] rows at flat `slots` = rows [n, Hkv, D] (same dtype)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    if is_fp8(cache.dtype):  # the CPU has no float8 index_copy_: the same bytes as uint8
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, rows)


def verify_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_q_len: int | None = None,
    rows_per_tile: int | None = None,
    causal: bool = True,
    plan: ForwardPlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`verify_attention_ref` over the plan's sequences: keys and values gathered already
    repeated per query head by one index each (an FP8 cache's scales repeated the same way)."""
    if plan is None or plan.meta is None or plan.causal != causal or not k_cache.is_contiguous():
        return verify_attention_ref(
            q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables, scale, out,
            num_splits=num_splits, max_q_len=max_q_len, rows_per_tile=rows_per_tile,
            causal=causal, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    check_kv_scales(k_cache, k_scale, v_scale)
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    seqs = plan.seqs(k_cache.shape[1], num_q_heads, num_kv_heads)
    if out is None:
        out = torch.empty_like(q)
    covered = seqs[-1]
    if covered < q.shape[0]:
        out[covered:].zero_()
    k_rows = k_cache.view(-1, head_dim)  # [blocks * page * Hkv, D]
    v_rows = v_cache.view(-1, head_dim)
    k_mul = v_mul = None
    if is_fp8(k_cache.dtype):  # query head h reads kv head h // group, and its scale
        group = num_q_heads // num_kv_heads
        k_mul = k_scale.repeat_interleave(group)[:, None]  # [Hq, 1]
        v_mul = v_scale.repeat_interleave(group)[:, None]
    for q_start, q_end, index, kv_len, mask in seqs[:-1]:
        # index_select copies whole rows; advanced indexing gathers element by element
        k = k_rows.index_select(0, index).view(kv_len, num_q_heads, head_dim).float()  # [L, Hq, D]
        v = v_rows.index_select(0, index).view(kv_len, num_q_heads, head_dim).float()
        if k_mul is not None:  # the reference's stored * scale, on the same operands
            k, v = k * k_mul, v * v_mul
        qs = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, q_len, L]
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
