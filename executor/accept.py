"""Acceptance of one round: from the target's logits of every row that needs them to the tokens
each request emits.

Greedy rows: the emitted token is the target's argmax. A SPEC group of `1 + d` rows fed
`[last, x_1 .. x_d]`: draft x_j is accepted while x_j == argmax(row j-1); the first mismatch emits
the target's argmax there (the correction), a fully accepted group emits the bonus argmax of row d.
This is exactly what plain greedy decoding would have produced, token for token.

Sampled rows (temperature > 0) use exact rejection sampling (Leviathan et al., Chen et al.):
with p the target's processed distribution at row j-1 and q the draft's at position j,
    accept x_j with probability min(1, p(x_j) / q(x_j));
    on rejection emit a sample of normalise(max(p - q, 0)) and stop;
    if every draft is accepted, emit a sample of p at row d (the bonus).
The emitted sequence then has exactly the target's distribution. A drafter without probabilities
is a point mass q = 1{x_j}: accept with probability p(x_j), on rejection sample p with x_j removed.
All random numbers come from the per-request counter-based generator keyed by (seed, token index,
purpose), so a seeded request gives the same output whatever the batch or the route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.plan import Mode, ReqPlan, TokenLogprob


@dataclass
class AcceptInputs:
    logits: torch.Tensor  # [num_logit_rows, vocab] float32, in plan order
    reqs: tuple[ReqPlan, ...]
    slots: dict  # slot -> SlotState
    drafts: dict[int, list[int]]  # req_id -> drafted tokens (SPEC only)
    draft_probs: torch.Tensor | None  # [sum(num_draft), vocab] or None
    forced_accept: list[int] | None = None  # synthetic drafter: accepted counts to take as given


@dataclass
class Accepted:
    token_ids: list[int]
    num_accepted: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None


def _greedy_prefix(drafts: list[int], target: list[int]) -> int:
    n = 0
    for x, t in zip(drafts, target):
        if x != t:
            break
        n += 1
    return n


def accept_batch(inp: AcceptInputs, sampler) -> list[Accepted]:
    logits = inp.logits
    greedy_ids = sampler.argmax(logits).tolist()  # one device->host copy for all greedy rows
    out: list[Accepted] = []
    row = 0
    draft_row = 0
    spec_i = 0
    for r in inp.reqs:
        st = inp.slots[r.slot]
        if r.mode == Mode.PREFILL and not r.sample:
            out.append(Accepted(token_ids=[]))
            continue
        n_rows = 1 if r.mode != Mode.SPEC else r.num_new
        rows = slice(row, row + n_rows)
        drafts = inp.drafts.get(r.req_id, [])
        if r.mode == Mode.SPEC and inp.forced_accept is not None:
            # synthetic acceptance: the drafter decided the count; emit the target's own tokens
            n_acc = min(inp.forced_accept[spec_i], r.num_draft)
            tokens = greedy_ids[row : row + n_acc + 1]
        elif st.sampling.greedy:
            if r.mode == Mode.SPEC:
                n_acc = _greedy_prefix(drafts, greedy_ids[rows])
                tokens = [*drafts[:n_acc], greedy_ids[row + n_acc]]
            else:
                n_acc, tokens = 0, [greedy_ids[row]]
        else:
            q = None
            if r.mode == Mode.SPEC and inp.draft_probs is not None:
                q = inp.draft_probs[draft_row : draft_row + r.num_draft]
            n_acc, tokens = sampler.rejection_sample(
                logits[rows], drafts if r.mode == Mode.SPEC else [], q, st, r.num_computed
            )
        logprobs = None
        if st.sampling.logprobs is not None:
            logprobs = sampler.logprobs(
                logits[row : row + len(tokens)], tokens, st.sampling.logprobs
            )
        out.append(Accepted(token_ids=tokens, num_accepted=n_acc, logprobs=logprobs))
        row += n_rows
        if r.mode == Mode.SPEC:
            draft_row += r.num_draft
            spec_i += 1
    return out
