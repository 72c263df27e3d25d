"""Acceptance of one round: from the target's logits of every row that needs them to the tokens
each request emits, exactly as plain decoding would produce them (greedy match, or rejection
sampling with the target's distribution kept; the rules are written next to `launch_accept`).

Two halves, so the host can work while the device runs:
- `launch_accept` enqueues everything for all rows at once on the device (penalties, argmax,
  seeded draws, the rejection tests) and starts ONE copy of the per-row results (argmax, draw,
  accept flag, residual draw) into pinned host memory;
- `finish_accept` waits for that copy; `walk_groups` / `round_tokens` walk every group's accepted
  prefix with array operations (no per-request Python).
Random numbers come from the counter-based generator keyed by (seed, position of the token,
purpose): a seeded request gives the same output whatever the batch, and AR rows and the bonus
draw of a fully accepted group use the same numbers for the same position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor import sampling
from executor.rng import Stream
from scheduler.plan import TokenLogprob, offsets

# rows of the packed per-row result copied to the host
_GREEDY, _DRAW, _ACCEPT, _RESIDUAL = range(4)
LOGPROB_FLOOR = -9999.0  # reported for tokens of probability 0


@dataclass(frozen=True)
class AcceptLaunch:
    """The device half of a round's acceptance, in flight."""

    logits: torch.Tensor  # [L, V] penalised logits (logprobs are computed from them)
    packed: torch.Tensor  # [4, L] int64 host tensor (pinned on a GPU), filled by the copy
    packed_dev: torch.Tensor  # [4, L] int64 on the device: the same results before the copy
    event: torch.cuda.Event | None  # recorded after the copy; None on a CPU (already done)
    has_draws: bool  # rows _DRAW.. hold data (some row samples)
    has_rejection: bool  # rows _ACCEPT/_RESIDUAL hold data (drafts with a distribution)

    def tokens_dev(self, greedy: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[num_rows] int64 on the device: the token each of the first `num_rows` rows emits
        when no draft follows it (its argmax, or its draw where `greedy` [>= num_rows] bool
        says it samples), without waiting for the copy."""
        tokens = self.packed_dev[_GREEDY, :num_rows]
        if self.has_draws:
            tokens = torch.where(greedy[:num_rows], tokens, self.packed_dev[_DRAW, :num_rows])
        return tokens


def launch_accept(
    logits: torch.Tensor,  # [L, V] float32, logit rows in row order
    st: sampling.SamplingTensors,
    sampler,
    row_slots: np.ndarray,  # [L] slot of each logit row (penalties only)
    preceding: list[list[int]] | None,  # per logit row the drafts before it (penalties only)
    next_draft: torch.Tensor,  # [L] int64 on the device: draft fed at the next row, -1: none
    draft_probs: torch.Tensor | None,  # [num draft rows, vocab] or None
    draft_rows: torch.Tensor | None,  # [num draft rows] logit rows the drafts' q belong to
    coupled: torch.Tensor | None = None,  # [L] bool: rows whose drafts share the target's noise
    constraints=None,  # DeviceConstraints: logit bias and grammar masks of some rows, or None
) -> AcceptLaunch:
    """Greedy rows: the emitted token is the target's argmax (after penalties). A SPEC group of
    `1 + d` rows fed `[last, x_1 .. x_d]`: draft x_j is accepted while x_j == argmax(row j-1);
    the first mismatch emits the target's argmax there (the correction), a fully accepted group
    emits the bonus argmax of row d: exactly what plain greedy decoding would have produced.

    Sampled rows (temperature > 0) use exact rejection sampling (Leviathan et al., Chen et al.):
    with p the target's processed distribution at row j-1 and q the draft's at position j,
        accept x_j with probability min(1, p(x_j) / q(x_j))      (test: u * q(x_j) < p(x_j));
        on rejection emit a sample of normalise(max(p - q, 0)) and stop;
        if every draft is accepted, emit a sample of p at row d (the bonus).
    The emitted sequence then has exactly the target's distribution.

    A drafter without probabilities (prompt lookup) is a point mass q = 1{x_j}; the rule becomes
    accept with probability p(x_j), on rejection emit a sample of p with x_j removed. It is
    realised with the numbers plain decoding uses: the target's own draw y_j at row j-1 (the
    exponential race, keyed by the token's position) is taken, and x_j is accepted iff
    x_j == y_j. That happens with probability p(x_j), and on a mismatch y_j is a draw of p
    conditioned on not being x_j, so the rule holds exactly, and the emitted tokens are the
    very tokens plain decoding would have drawn with that seed: a seeded request's output does
    not depend on the route.

    `coupled` rows take that rule for drafts with a distribution too: a request with its own
    seed has its drafts drawn with the numbers of the target's own draws (`pick_drafts`), so
    x_j == y_j whenever both races pick the same token (Gumbel-max coupling), and every emitted
    token is the target's own draw: exact, and the output plain decoding gives with that seed.
    Rejection sampling accepts more (1 - TV(p, q) per draft, the most any rule can), which is
    why requests without a seed keep it.

    `constraints` change p itself, before everything above: a row's logit bias is added and its
    grammar's mask (after the drafts before the row) sets forbidden tokens to -inf. Every rule
    then holds for the constrained p: a draft the grammar forbids has p(x_j) = 0 and is
    rejected whatever its q, and a correction or bonus is drawn from the constrained p."""
    num_rows, vocab = logits.shape
    dev = logits.device
    if constraints is not None:
        logits = constraints.apply(logits)  # [L, V]
    if st.use_penalties:
        logits = sampler.penalize(logits, st, row_slots.tolist(), preceding)  # [L, V]
    packed_dev = torch.empty((4, num_rows), dtype=torch.int64, device=dev)  # [4, L]
    packed_dev[_GREEDY] = logits.argmax(dim=-1)
    has_draws = has_rejection = False
    if not st.all_greedy:
        has_draws = True
        probs = sampling.process_logits(logits, st)  # [L, V]
        packed_dev[_DRAW] = sampling.sample_from_probs(probs, st, Stream.SAMPLE)
        if draft_probs is not None and draft_rows is not None:  # the rejection test
            has_rejection = True
            q = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)  # [L, V]
            q.index_copy_(0, draft_rows, draft_probs)
            has_next = next_draft >= 0  # [L]
            x = next_draft.clamp(min=0)[:, None]  # [L, 1]
            p_x = probs.gather(1, x)[:, 0]  # [L]
            q_x = q.gather(1, x)[:, 0]
            residual = (probs - q).clamp(min=0.0)
            u = sampling.uniforms(st, 1, Stream.ACCEPT)[:, 0]  # [L]
            accept = u * q_x < p_x  # [L]
            residual_draw = sampling.sample_from_probs(residual, st, Stream.RESIDUAL)  # [L]
            if coupled is not None:
                draw = packed_dev[_DRAW]
                accept = torch.where(coupled, next_draft == draw, accept)
                residual_draw = torch.where(coupled, draw, residual_draw)
            packed_dev[_ACCEPT] = (has_next & accept).to(torch.int64)
            packed_dev[_RESIDUAL] = residual_draw
    event = None
    if dev.type == "cuda":
        packed = torch.empty((4, num_rows), dtype=torch.int64, pin_memory=True)
        packed.copy_(packed_dev, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        packed = packed_dev
    return AcceptLaunch(logits, packed, packed_dev, event, has_draws, has_rejection)


def finish_accept(launch: AcceptLaunch) -> np.ndarray:
    """Waits for the copy; returns the per-row results [4, L] int64 on the host."""
    if launch.event is not None:
        launch.event.synchronize()
    return launch.packed.numpy()


def walk_groups(
    host: np.ndarray,  # [4, L] from finish_accept
    input_ids: np.ndarray,  # [R] the round's input ids (drafts are fed at rows 1..d of a group)
    group_rows: np.ndarray,  # [n + 1] row starts of the decode groups (logit rows = rows there)
    num_draft: np.ndarray,  # [n]
    greedy: np.ndarray,  # [n] bool: the request decodes greedily
    has_rejection: bool,
    forced_accept: np.ndarray | None,  # [n] accepted counts given by a synthetic drafter
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode groups' accepted prefixes, all at once. Returns (num_accepted [n],
    num_emitted [n], flat emitted tokens [sum(num_emitted)]): per group the accepted drafts,
    then the correction or bonus token."""
    n = len(num_draft)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    num_rows = int(group_rows[-1])
    if num_rows == n:  # no drafts (AR rows only): each row emits its own token
        token = host[_GREEDY, :n] if forced_accept is not None else None
        if token is None:
            token = np.where(greedy, host[_GREEDY, :n], host[_DRAW, :n])
        return np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), token
    rows_per = np.diff(group_rows)  # [n] = 1 + num_draft
    owner = np.repeat(np.arange(n), rows_per)  # [R] group of each row
    j = np.arange(num_rows) - group_rows[owner]  # [R] row index inside its group
    has_next = j < num_draft[owner]  # [R] a draft is fed at the next row
    fed = np.zeros(num_rows, dtype=np.int64)
    fed[:-1] = input_ids[1:num_rows]  # [R] the token fed at the next row
    greedy_ids = host[_GREEDY, :num_rows]
    row_greedy = greedy[owner]  # [R]
    # Per row: does its draft survive, and which token ends the group if the chain stops here.
    if forced_accept is not None:
        # synthetic acceptance: the drafter decided the count; emit the target's own tokens
        num_accepted = np.minimum(forced_accept, num_draft)
        tokens_at = greedy_ids
    else:
        draw = host[_DRAW, :num_rows]
        if has_rejection:
            match = np.where(row_greedy, fed == greedy_ids, host[_ACCEPT, :num_rows] > 0)
            stop_token = np.where(has_next, host[_RESIDUAL, :num_rows], draw)
            end_token = np.where(row_greedy, greedy_ids, stop_token)
        else:  # greedy match, or point-mass drafts matched against the target's own draws
            end_token = np.where(row_greedy, greedy_ids, draw)
            match = fed == end_token
        # first row whose draft is rejected (or the last row): the accepted count
        stop_at = np.where(has_next & match, num_rows, j)  # [R]
        num_accepted = np.minimum.reduceat(stop_at, group_rows[:-1])
        tokens_at = end_token
    num_emitted = num_accepted + 1
    # emitted token k of group i: the draft fed at row k + 1 for k < accepted (the target's own
    # token there when forced), then the end token of row `accepted`
    tok_owner = np.repeat(np.arange(n), num_emitted)
    k = np.arange(int(num_emitted.sum())) - np.repeat(
        np.cumsum(num_emitted) - num_emitted, num_emitted
    )
    row = group_rows[tok_owner] + k
    last = k == num_accepted[tok_owner]
    if forced_accept is not None:
        tokens = tokens_at[row]
    else:
        tokens = np.where(last, tokens_at[row], fed[row])
    return num_accepted, num_emitted, tokens


@dataclass(frozen=True)
class RoundTokens:
    """What the requests of a round emit, in row order (decode requests, then prefill chunks)."""

    num_accepted: np.ndarray  # [m] accepted drafts
    num_emitted: np.ndarray  # [m]
    tokens: np.ndarray  # [sum(num_emitted)] int64, request after request

    @property
    def starts(self) -> np.ndarray:
        """[m + 1] where each request's tokens start in `tokens`."""
        return offsets(self.num_emitted)


def round_tokens(
    host: np.ndarray,  # [4, L] from finish_accept
    input_ids: np.ndarray,  # [R] the round's input ids, drafts included
    group_rows: np.ndarray,  # [m + 1] row starts of every request's rows
    num_draft: np.ndarray,  # [n] drafts of the n decode requests (the first n)
    greedy: np.ndarray,  # [m] bool: the request decodes greedily
    has_rejection: bool,
    forced_accept: np.ndarray | None,  # [n] accepted counts given by a synthetic drafter
    sample_of: np.ndarray,  # [k] requests (prefill chunks) that sample at their last row
) -> RoundTokens:
    """The decode groups' accepted prefixes (`walk_groups`), then the token each sampling
    prefill chunk draws at its logit row (those follow the decode rows); a partial chunk
    emits nothing."""
    n, m = len(num_draft), len(greedy)
    num_accepted, emitted_dec, tokens_dec = walk_groups(
        host, input_ids, group_rows[: n + 1], num_draft, greedy[:n], has_rejection, forced_accept
    )
    num_emitted = np.zeros(m, dtype=np.int64)
    num_emitted[:n] = emitted_dec
    num_emitted[sample_of] = 1
    accepted = np.zeros(m, dtype=np.int64)
    accepted[:n] = num_accepted
    logit_row = int(group_rows[n]) + np.arange(len(sample_of))
    which = np.where(greedy[sample_of], _GREEDY, _DRAW)
    sample_tokens = host[which, logit_row] if len(sample_of) else np.zeros(0, np.int64)
    tokens = np.concatenate([tokens_dec, sample_tokens]).astype(np.int64)
    return RoundTokens(accepted, num_emitted, tokens)


def emitted_logprobs(
    logits: torch.Tensor,  # [L, V] penalised (AcceptLaunch.logits)
    emitted: RoundTokens,
    ks: np.ndarray,  # [m] top alternatives each request asks for, -1: no logprobs
    group_rows: np.ndarray,  # [m + 1]
    num_decode: int,
    sample_of: np.ndarray,  # [k] as for round_tokens
) -> dict[int, tuple[TokenLogprob, ...]]:
    """Per request that asks (by its index in row order), the logprobs of its emitted tokens."""
    num_emitted = emitted.num_emitted
    asking = np.flatnonzero((ks >= 0) & (num_emitted > 0))
    if not len(asking):
        return {}
    starts = emitted.starts
    num_dec_rows = int(group_rows[num_decode])
    rows, ids, kk, owners = [], [], [], []
    for i in asking.tolist():
        first = (
            int(group_rows[i])
            if i < num_decode
            else num_dec_rows + int(np.flatnonzero(sample_of == i)[0])
        )
        for k in range(int(num_emitted[i])):
            rows.append(first + k)
            ids.append(int(emitted.tokens[starts[i] + k]))
            kk.append(int(ks[i]))
            owners.append(i)
    lps = logprobs_of(logits, rows, ids, kk)
    out: dict[int, list] = {}
    for i, lp in zip(owners, lps):
        out.setdefault(i, []).append(lp)
    return {i: tuple(v) for i, v in out.items()}


def logprobs_of(
    logits: torch.Tensor,  # [L, V] penalised
    rows: list[int],  # logit rows of the emitted tokens that want logprobs
    token_ids: list[int],
    ks: list[int],  # top-k alternatives per entry
) -> list[TokenLogprob]:
    """Logprobs of emitted tokens (one more device op and copy; only requests that ask)."""
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
    chosen, top_ids, top_lps = sampling.compute_logprobs(logits[idx], ids, max(ks))
    # a grammar's forbidden tokens have logprob -inf, which JSON cannot carry: floored as vLLM
    # floors them
    chosen, top_lps = chosen.clamp(min=LOGPROB_FLOOR), top_lps.clamp(min=LOGPROB_FLOOR)
    chosen, top_ids, top_lps = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
    return [
        TokenLogprob(token_ids[n], chosen[n], tuple(zip(top_ids[n][:k], top_lps[n][:k])))
        for n, k in enumerate(ks)
    ]
