"""Acceptance of one round: from the target's logits of every row that needs them to the tokens
each request emits.

Greedy rows: the emitted token is the target's argmax (after penalties). A SPEC group of
`1 + d` rows fed `[last, x_1 .. x_d]`: draft x_j is accepted while x_j == argmax(row j-1); the
first mismatch emits the target's argmax there (the correction), a fully accepted group emits the
bonus argmax of row d. This is exactly what plain greedy decoding would have produced.

Sampled rows (temperature > 0) use exact rejection sampling (Leviathan et al., Chen et al.):
with p the target's processed distribution at row j-1 and q the draft's at position j,
    accept x_j with probability min(1, p(x_j) / q(x_j))      (test: u * q(x_j) < p(x_j));
    on rejection emit a sample of normalise(max(p - q, 0)) and stop;
    if every draft is accepted, emit a sample of p at row d (the bonus).
The emitted sequence then has exactly the target's distribution.

A drafter without probabilities (prompt lookup) is a point mass q = 1{x_j}; the rule becomes
accept with probability p(x_j), on rejection emit a sample of p with x_j removed. It is realised
with the same numbers plain decoding uses: the target's own draw y_j at row j-1 (the exponential
race below, keyed by the token's position) is taken, and x_j is accepted iff x_j == y_j. That
happens with probability p(x_j), and on a mismatch y_j is a draw of p conditioned on not being
x_j, so the rule holds exactly, and the emitted tokens are the very tokens plain decoding would
have drawn with that seed: a seeded request's output does not depend on the route.

Everything is computed for all rows at once on the device; small vectors go to the host (per
row the argmax, the plain draw, and for drafts with a distribution the accept flag and the
residual draw), which then walks each group's prefix. Random numbers come from the
counter-based generator keyed by (seed, position of the token, purpose): a seeded request gives
the same output whatever the batch, and AR rows and the bonus draw of a fully accepted group use
the same numbers for the same position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor import sampling
from executor.rng import Stream
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


@dataclass
class _Rows:
    """Per logit row: whose it is and what it samples."""

    specs: list
    req_ids: list[int]
    steps: list[int]  # sequence index of the token the row samples
    slots: list[int]
    next_draft: list[int]  # draft fed at the next row (-1: none)
    preceding: list[list[int]]  # drafts before this row inside its group (count as output)


def _collect_rows(inp: AcceptInputs) -> _Rows:
    rows = _Rows([], [], [], [], [], [])
    for r in inp.reqs:
        if r.mode == Mode.PREFILL and not r.sample:
            continue
        st = inp.slots[r.slot]
        first_pos = r.num_computed + r.num_new - 1 if r.mode == Mode.PREFILL else r.num_computed
        n = r.num_new if r.mode == Mode.SPEC else 1
        drafts = inp.drafts.get(r.req_id, [])
        for j in range(n):
            rows.specs.append(st.sampling)
            rows.req_ids.append(r.req_id)
            rows.steps.append(first_pos + j + 1)
            rows.slots.append(r.slot)
            rows.next_draft.append(drafts[j] if j < len(drafts) else -1)
            rows.preceding.append(drafts[:j])
    return rows


def _draft_rows(inp: AcceptInputs, num_rows: int, vocab: int, device) -> torch.Tensor | None:
    """Draft distributions aligned to logit rows [num_rows, vocab] (zeros where none)."""
    if inp.draft_probs is None:
        return None
    q = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    row = 0
    k = 0
    for r in inp.reqs:
        if r.mode == Mode.PREFILL and not r.sample:
            continue
        if r.mode == Mode.SPEC:
            q[row : row + r.num_draft] = inp.draft_probs[k : k + r.num_draft]
            k += r.num_draft
            row += r.num_new
        else:
            row += 1
    return q


def accept_batch(inp: AcceptInputs, sampler) -> list[Accepted]:
    logits = inp.logits  # [L, V]
    num_rows, vocab = logits.shape
    dev = logits.device
    rows = _collect_rows(inp)
    st = sampling.SamplingTensors.build(
        rows.specs,
        rows.req_ids,
        rows.steps,
        vocab_size=vocab,
        base_seed=sampler.base_seed,
        device=dev,
    )
    logits = sampler.penalize(logits, st, rows.slots, rows.preceding)  # [L, V]
    greedy_t = logits.argmax(dim=-1)  # [L]
    host = {"greedy": greedy_t}
    if not st.all_greedy:
        probs = sampling.process_logits(logits, st)  # [L, V]
        host["draw"] = sampling.sample_from_probs(probs, st, Stream.SAMPLE)  # [L]
        q = _draft_rows(inp, num_rows, vocab, dev) if inp.drafts else None
        if q is not None:  # drafts with a distribution: the rejection test
            nxt = torch.tensor(rows.next_draft, dtype=torch.int64).to(dev, non_blocking=True)
            has_next = nxt >= 0  # [L]
            x = nxt.clamp(min=0)[:, None]  # [L, 1]
            p_x = probs.gather(1, x)[:, 0]  # [L]
            q_x = q.gather(1, x)[:, 0]
            residual = (probs - q).clamp(min=0.0)
            u = sampling.uniforms(st, 1, Stream.ACCEPT)[:, 0]  # [L]
            host["accept"] = has_next & (u * q_x < p_x)
            host["residual"] = sampling.sample_from_probs(residual, st, Stream.RESIDUAL)
    out_host = {k: v.tolist() for k, v in host.items()}  # one sync for all of them
    greedy_ids = out_host["greedy"]

    results: list[Accepted] = []
    row = 0
    spec_i = 0
    for r in inp.reqs:
        st_slot = inp.slots[r.slot]
        if r.mode == Mode.PREFILL and not r.sample:
            results.append(Accepted(token_ids=[]))
            continue
        greedy = st_slot.sampling.greedy
        if r.mode != Mode.SPEC:
            tok = greedy_ids[row] if greedy else out_host["draw"][row]
            results.append(Accepted(token_ids=[tok]))
            row += 1
            continue
        drafts = inp.drafts[r.req_id]
        d = r.num_draft
        if inp.forced_accept is not None:
            # synthetic acceptance: the drafter decided the count; emit the target's own tokens
            n_acc = min(inp.forced_accept[spec_i], d)
            tokens = greedy_ids[row : row + n_acc + 1]
        elif greedy:
            n_acc = 0
            while n_acc < d and drafts[n_acc] == greedy_ids[row + n_acc]:
                n_acc += 1
            tokens = [*drafts[:n_acc], greedy_ids[row + n_acc]]
        elif "accept" in out_host:
            acc = out_host["accept"]
            n_acc = 0
            while n_acc < d and acc[row + n_acc]:
                n_acc += 1
            last = out_host["draw"][row + d] if n_acc == d else out_host["residual"][row + n_acc]
            tokens = [*drafts[:n_acc], last]
        else:  # point-mass drafts: matched against the target's own draws (module doc)
            draw = out_host["draw"]
            n_acc = 0
            while n_acc < d and drafts[n_acc] == draw[row + n_acc]:
                n_acc += 1
            tokens = [*drafts[:n_acc], draw[row + n_acc]]
        results.append(Accepted(token_ids=tokens, num_accepted=n_acc))
        row += r.num_new
        spec_i += 1
    _add_logprobs(inp, logits, results)
    return results


def _add_logprobs(inp: AcceptInputs, logits: torch.Tensor, results: list[Accepted]) -> None:
    """Logprobs of the emitted tokens, for the requests that asked (one more device op)."""
    wanted_rows, wanted_ids, owners = [], [], []
    row = 0
    max_k = 0
    for i, (r, acc) in enumerate(zip(inp.reqs, results)):
        if r.mode == Mode.PREFILL and not r.sample:
            continue
        k = inp.slots[r.slot].sampling.logprobs
        if k is not None:
            max_k = max(max_k, k)
            for j, tok in enumerate(acc.token_ids):
                wanted_rows.append(row + j)
                wanted_ids.append(tok)
                owners.append((i, k))
        row += r.num_new if r.mode == Mode.SPEC else 1
    if not wanted_rows:
        return
    dev = logits.device
    idx = torch.tensor(wanted_rows, dtype=torch.int64, device=dev)
    ids = torch.tensor(wanted_ids, dtype=torch.int64, device=dev)
    chosen, top_ids, top_lps = sampling.compute_logprobs(logits[idx], ids, max_k)
    chosen, top_ids, top_lps = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
    per_req: dict[int, list[TokenLogprob]] = {}
    for n, (i, k) in enumerate(owners):
        top = tuple(zip(top_ids[n][:k], top_lps[n][:k]))
        per_req.setdefault(i, []).append(TokenLogprob(wanted_ids[n], chosen[n], top))
    for i, lps in per_req.items():
        results[i].logprobs = tuple(lps)
