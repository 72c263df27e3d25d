"""Acceptance of drafted tokens on the device: greedy matching and exact rejection sampling.

Rows of sequence s are `cu_rows[s] .. cu_rows[s+1]-1` (n_s rows; n_s = 0 for graph padding).
Row i of a sequence is the target's prediction for the position after the token fed at row i.
`draft_ids[row i]` is the drafted token fed at row i+1, i.e. the draft for the position that
row i predicts; the last row's entry is unused (there is no row after it). So a sequence with n
rows carries n-1 drafts, and emits between 1 and n tokens. The rule of each kind is written
beside its wrapper (`accept_greedy`, `accept_rejection`).

Outputs (only these leave the device): num_accepted [S] int32 = a, the drafts accepted (0 for
padding), out_tokens [S, max_rows] int32 with the a+1 emitted tokens first and -1 after them (all
-1 for padding). A sequence with more than max_rows rows is treated as having its first max_rows
rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options

_ID_DTYPES = (torch.int32, torch.int64)


# Round-varying counts are not specialised: a new value class (1, a multiple of 16) would
# compile a variant (seconds) inside a serving round.
@triton.jit(do_not_specialize=["max_rows"])
def _accept_greedy_kernel(
    target_ptr, draft_ptr, cu_rows_ptr, num_acc_ptr, out_ptr, max_rows,
    ROWS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    r0 = tl.load(cu_rows_ptr + seq)
    n = tl.minimum(tl.load(cu_rows_ptr + seq + 1) - r0, max_rows)
    offs = tl.arange(0, ROWS_PAD)
    target = tl.load(target_ptr + r0 + offs, mask=offs < n, other=-1).to(tl.int32)
    draft = tl.load(draft_ptr + r0 + offs, mask=offs < n - 1, other=-1).to(tl.int32)
    miss = (draft != target) & (offs < n - 1)
    num_acc = tl.maximum(tl.min(tl.where(miss, offs, n - 1), 0), 0)
    tl.store(num_acc_ptr + seq, num_acc)
    tokens = tl.where((offs <= num_acc) & (offs < n), target, -1)
    tl.store(out_ptr + seq.to(tl.int64) * max_rows + offs, tokens, mask=offs < max_rows)


def _check_rows(cu_rows: torch.Tensor, num_rows: int, max_rows: int | None) -> tuple[int, int]:
    assert cu_rows.dim() == 1 and cu_rows.dtype == torch.int32 and cu_rows.is_contiguous()
    num_seqs = cu_rows.shape[0] - 1
    max_rows = num_rows if max_rows is None else max_rows
    assert max_rows >= 1
    return num_seqs, max_rows


def accept_greedy(
    target_ids: torch.Tensor,
    draft_ids: torch.Tensor,
    cu_rows: torch.Tensor,
    *,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids, draft_ids [num_rows] int32/int64; cu_rows [S+1] int32; max_rows: a host-side
    bound on rows per sequence (the spec depth), default num_rows.
    Returns (num_accepted [S] int32, out_tokens [S, max_rows] int32, -1 padded).

    With target_ids[row] the argmax of the target at that row and r0 a sequence's first row:
        a = longest prefix length with draft_ids[r0+i] == target_ids[r0+i], i < n-1
        emitted = target_ids[r0 : r0+a+1]  (the a accepted drafts, then the correction at the
                  first mismatch, or the bonus token when all n-1 drafts match)
    This is token-identical to greedy decoding one token at a time.
    """
    (num_rows,) = target_ids.shape  # [num_rows]
    assert draft_ids.shape == (num_rows,)
    assert target_ids.dtype in _ID_DTYPES and draft_ids.dtype in _ID_DTYPES
    assert target_ids.is_contiguous() and draft_ids.is_contiguous()
    num_seqs, max_rows = _check_rows(cu_rows, num_rows, max_rows)
    dev = target_ids.device
    num_acc = torch.empty((num_seqs,), dtype=torch.int32, device=dev)  # [S]
    out = torch.empty((num_seqs, max_rows), dtype=torch.int32, device=dev)  # [S, max_rows]
    if num_seqs > 0:
        _accept_greedy_kernel[(num_seqs,)](
            target_ids, draft_ids, cu_rows, num_acc, out, max_rows,
            ROWS_PAD=triton.next_power_of_2(max_rows), num_warps=1,
        )
    return num_acc, out


@triton.jit
def _residual_chunk(
    p_ptr, q_ptr, row, stride_p, stride_q, v0, offs_v, vocab, rejected, x_rej,
    HAS_Q: tl.constexpr,
):
    """p and the residual weights of vocabulary entries v0 + offs_v of `row`: max(p - q, 0)
    after a rejection (p with the rejected draft removed without draft probabilities), p on
    the bonus row."""
    v_ok = v0 + offs_v < vocab
    p = tl.load(p_ptr + row * stride_p + v0 + offs_v, mask=v_ok, other=0.0)
    if HAS_Q:
        q = tl.load(q_ptr + row * stride_q + v0 + offs_v, mask=v_ok, other=0.0)
        res = tl.maximum(p - tl.where(rejected, q, 0.0), 0.0)
    else:
        res = tl.where(rejected & (v0 + offs_v == x_rej), 0.0, p)
    return p, res


@triton.jit(do_not_specialize=["num_rows", "max_rows"])
def _accept_rejection_kernel(
    p_ptr, q_ptr, draft_ptr, cu_rows_ptr, u_ptr, ru_ptr, num_acc_ptr, out_ptr,
    num_rows, max_rows, vocab, stride_p, stride_q,
    HAS_Q: tl.constexpr, ROWS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    r0 = tl.load(cu_rows_ptr + seq)
    n = tl.minimum(tl.load(cu_rows_ptr + seq + 1) - r0, max_rows)
    offs = tl.arange(0, ROWS_PAD)
    is_draft = offs < n - 1
    rows = (r0 + offs).to(tl.int64)  # [ROWS_PAD]
    x = tl.load(draft_ptr + rows, mask=is_draft, other=0).to(tl.int64)
    p_x = tl.load(p_ptr + rows * stride_p + x, mask=is_draft, other=0.0)
    if HAS_Q:
        q_x = tl.load(q_ptr + rows * stride_q + x, mask=is_draft, other=0.0)
    else:
        q_x = tl.full([ROWS_PAD], 1.0, tl.float32)
    u = tl.load(u_ptr + rows, mask=is_draft, other=1.0)
    reject = (u * q_x >= p_x) & is_draft
    num_acc = tl.maximum(tl.min(tl.where(reject, offs, n - 1), 0), 0)

    # Draw the token at position num_acc: from the residual after a rejection, else the bonus.
    # Clamped so that a padding sequence (n = 0) past the last row still reads valid memory.
    row = tl.minimum(r0 + num_acc, num_rows - 1).to(tl.int64)
    rejected = num_acc < n - 1
    x_rej = tl.load(draft_ptr + row, mask=rejected, other=0).to(tl.int64)
    offs_v = tl.arange(0, CHUNK)
    res_total = 0.0
    p_total = 0.0
    for v0 in range(0, vocab, CHUNK):
        p, res = _residual_chunk(
            p_ptr, q_ptr, row, stride_p, stride_q, v0, offs_v, vocab, rejected, x_rej, HAS_Q
        )
        res_total += tl.sum(res, 0)
        p_total += tl.sum(p, 0)
    use_res = res_total > 0.0
    total = tl.where(use_res, res_total, p_total)
    target = tl.load(ru_ptr + row, mask=n > 0, other=0.0) * total
    running = 0.0
    chosen = vocab  # first index whose running sum exceeds target
    last_pos = 0  # fallback when rounding leaves target >= the final sum: last positive weight
    for v0 in range(0, vocab, CHUNK):
        p, res = _residual_chunk(
            p_ptr, q_ptr, row, stride_p, stride_q, v0, offs_v, vocab, rejected, x_rej, HAS_Q
        )
        w = tl.where(use_res, res, p)
        cum = running + tl.cumsum(w, 0)
        hit = (cum > target) & (w > 0.0)
        chosen = tl.minimum(chosen, tl.min(tl.where(hit, v0 + offs_v, vocab), 0))
        last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0.0, v0 + offs_v, 0), 0))
        running += tl.sum(w, 0)
    token = tl.where(chosen < vocab, chosen, last_pos).to(tl.int32)

    tl.store(num_acc_ptr + seq, num_acc)
    drafts = tl.load(draft_ptr + rows, mask=offs < num_acc, other=-1).to(tl.int32)
    tokens = tl.where(offs < num_acc, drafts, tl.where((offs == num_acc) & (n > 0), token, -1))
    tl.store(out_ptr + seq.to(tl.int64) * max_rows + offs, tokens, mask=offs < max_rows)


def accept_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    cu_rows: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    *,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [num_rows, V] fp32, draft_probs [num_rows, V] fp32 or None, draft_ids
    [num_rows] int32/int64, cu_rows [S+1] int32, uniforms / residual_uniforms [num_rows] fp32 in
    [0, 1). Returns (num_accepted [S] int32, out_tokens [S, max_rows] int32, -1 padded).

    p_i = target_probs[r0+i] (temperature, top-k, top-p, min-p already applied, rows summing
    to 1), q_i = draft_probs[r0+i] the drafter's distribution for the same position,
    x_i = draft_ids[r0+i], u_i = uniforms[r0+i]:
        draft i is accepted iff u_i * q_i(x_i) < p_i(x_i)   (probability min(1, p/q))
        a = number of drafts accepted before the first rejection
        if a < n-1: the token at position a is drawn from max(p_a - q_a, 0), renormalised
        else:       the bonus token is drawn from p_{n-1}
    For a drafter without probabilities (`draft_probs=None`, a point mass on x_i): accept iff
    u_i < p_i(x_i); on rejection draw from p_a with x_a removed, renormalised. Either way the
    emitted tokens have exactly the target's distribution (Leviathan et al. 2023, Chen et al.
    2023). The draw uses inverse-CDF sampling with `residual_uniforms[r0+a]`: the first token
    whose running sum of weights exceeds u * total. If the residual has no mass (p == q up to
    rounding), p_a is used.
    """
    num_rows, vocab = target_probs.shape  # [num_rows, V]
    assert target_probs.dtype == torch.float32 and target_probs.stride(1) == 1
    if draft_probs is not None:
        assert draft_probs.shape == target_probs.shape and draft_probs.dtype == torch.float32
        assert draft_probs.stride(1) == 1
    assert draft_ids.shape == (num_rows,) and draft_ids.dtype in _ID_DTYPES
    assert uniforms.shape == (num_rows,) and uniforms.dtype == torch.float32
    assert residual_uniforms.shape == (num_rows,) and residual_uniforms.dtype == torch.float32
    assert draft_ids.is_contiguous() and uniforms.is_contiguous()
    assert residual_uniforms.is_contiguous()
    num_seqs, max_rows = _check_rows(cu_rows, num_rows, max_rows)
    dev = target_probs.device
    num_acc = torch.empty((num_seqs,), dtype=torch.int32, device=dev)  # [S]
    out = torch.empty((num_seqs, max_rows), dtype=torch.int32, device=dev)  # [S, max_rows]
    if num_rows == 0:  # padding only
        num_acc.zero_()
        out.fill_(-1)
    elif num_seqs > 0:
        cfg = arch_config(dev)
        q = draft_probs if draft_probs is not None else target_probs
        _accept_rejection_kernel[(num_seqs,)](
            target_probs, q, draft_ids, cu_rows, uniforms, residual_uniforms, num_acc, out,
            num_rows, max_rows, vocab, target_probs.stride(0), q.stride(0),
            HAS_Q=draft_probs is not None, ROWS_PAD=triton.next_power_of_2(max_rows),
            CHUNK=min(cfg.vocab_chunk, triton.next_power_of_2(vocab)),
            num_warps=cfg.row_warps, **launch_options(dev, cfg.waves_per_eu),
        )
    return num_acc, out


def _ref_outputs(
    cu_rows: torch.Tensor, num_rows: int, max_rows: int | None
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """A reference's host outputs before any sequence is accepted (num_accepted 0, out_tokens
    all -1) and (seq, first row, rows) of every sequence with rows, capped at max_rows."""
    num_seqs = cu_rows.shape[0] - 1
    max_rows = num_rows if max_rows is None else max_rows
    num_acc = torch.zeros((num_seqs,), dtype=torch.int32)  # [S]
    out = torch.full((num_seqs, max_rows), -1, dtype=torch.int32)  # [S, max_rows]
    cu = cu_rows.tolist()
    seqs = [(seq, cu[seq], min(cu[seq + 1] - cu[seq], max_rows)) for seq in range(num_seqs)]
    return num_acc, out, [(seq, r0, n) for seq, r0, n in seqs if n != 0]


def accept_greedy_ref(
    target_ids: torch.Tensor,
    draft_ids: torch.Tensor,
    cu_rows: torch.Tensor,
    *,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, host loop over sequences; same outputs as `accept_greedy`."""
    num_acc, out, seqs = _ref_outputs(cu_rows, target_ids.shape[0], max_rows)
    target, draft = target_ids.tolist(), draft_ids.tolist()
    for seq, r0, n in seqs:
        a = 0
        while a < n - 1 and draft[r0 + a] == target[r0 + a]:
            a += 1
        num_acc[seq] = a
        out[seq, : a + 1] = torch.tensor(target[r0 : r0 + a + 1], dtype=torch.int32)
    return num_acc.to(target_ids.device), out.to(target_ids.device)


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """First index whose running sum exceeds u * total (last positive weight on rounding)."""
    cum = torch.cumsum(weights, 0)
    hit = ((cum > u * float(weights.sum())) & (weights > 0)).nonzero()
    if hit.numel():
        return int(hit[0])
    return int((weights > 0).nonzero()[-1])


def accept_rejection_ref(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    cu_rows: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    *,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, host loop over sequences; the rule of `accept_rejection`, step by step."""
    num_acc, out, seqs = _ref_outputs(cu_rows, target_probs.shape[0], max_rows)
    p_all, ids = target_probs.float().cpu(), draft_ids.tolist()
    q_all = None if draft_probs is None else draft_probs.float().cpu()
    u, ru = uniforms.tolist(), residual_uniforms.tolist()
    for seq, r0, n in seqs:
        a = 0
        while a < n - 1:
            x = ids[r0 + a]
            q_x = 1.0 if q_all is None else float(q_all[r0 + a, x])
            if not u[r0 + a] * q_x < float(p_all[r0 + a, x]):
                break
            a += 1
        p = p_all[r0 + a]
        if a < n - 1:
            if q_all is None:
                res = p.clone()
                res[ids[r0 + a]] = 0.0
            else:
                res = (p - q_all[r0 + a]).clamp_min(0.0)
            weights = res if float(res.sum()) > 0.0 else p
        else:
            weights = p
        num_acc[seq] = a
        out[seq, :a] = torch.tensor(ids[r0 : r0 + a], dtype=torch.int32)
        out[seq, a] = _inverse_cdf(weights, ru[r0 + a])
    return num_acc.to(target_probs.device), out.to(target_probs.device)
