"""Measurements of the demo pair: validation perplexity, greedy samples, speculative acceptance.

Acceptance is measured the way greedy verification works: the target's greedy continuation of a
prompt is the reference; at each round a drafter proposes up to `depth - 1` tokens from the
committed context, the accepted count is the length of the proposal's common prefix with the
reference, and the round emits `accepted + 1` tokens (the accepted drafts plus the target's own
next token). Two drafters:
- `ngram` (prompt lookup): the longest suffix of the context, 3 tokens down to 1, that occurred
  earlier in the context; it proposes the tokens that followed its latest earlier occurrence;
- `draft-model`: the draft model's greedy chain from the same context.

Works on any device; the models here are `DemoCausalLM` (full recompute, no KV cache: these
models are small and the sequences short).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

NGRAM_MAX_N = 3
NGRAM_MIN_N = 1


def ngram_propose(
    context: Sequence[int], num_draft: int, max_n: int = NGRAM_MAX_N, min_n: int = NGRAM_MIN_N
) -> list[int]:
    """Prompt-lookup proposal: tokens that followed the latest earlier match of the longest
    context suffix (length max_n down to min_n). Empty when no suffix recurs."""
    ctx_len = len(context)
    for n in range(min(max_n, ctx_len - 1), min_n - 1, -1):
        suffix = list(context[ctx_len - n :])
        # latest earlier occurrence whose end is before the suffix itself
        for start in range(ctx_len - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                follow = start + n
                return list(context[follow : follow + num_draft])
    return []


def accepted_prefix_len(proposal: Sequence[int], reference: Sequence[int]) -> int:
    num = 0
    for p, r in zip(proposal, reference):
        if p != r:
            break
        num += 1
    return num


@dataclass(frozen=True)
class RoundStats:
    num_rounds: int
    num_emitted: int
    mean_accepted_len: float  # tokens per round: accepted drafts + 1
    mean_accepted_drafts: float
    proposal_rate: float  # share of rounds where the drafter proposed anything
    position_acceptance: list[float]  # a_k: P(draft k accepted | drafts 1..k-1 accepted)

    def as_dict(self) -> dict:
        return asdict(self)


def simulate_rounds(
    reference: Sequence[int],
    num_gen: int,
    num_draft: int,
    propose: Callable[[int], Sequence[int]],
) -> list[tuple[int, int]]:
    """Walks one greedy generation of num_gen tokens in speculative rounds.

    propose(i) gives the drafter's proposal after i generated tokens; reference must hold at
    least num_gen + num_draft tokens. Returns (num_proposed, num_accepted) per round."""
    rounds = []
    i = 0
    while i < num_gen:
        proposal = list(propose(i))[:num_draft]
        accepted = accepted_prefix_len(proposal, reference[i : i + num_draft])
        rounds.append((len(proposal), accepted))
        i += accepted + 1
    return rounds


def summarize_rounds(rounds: list[tuple[int, int]], num_draft: int) -> RoundStats:
    accepted = np.array([a for _, a in rounds], dtype=np.float64)
    proposed = np.array([p for p, _ in rounds], dtype=np.float64)
    position_acceptance = []
    for k in range(1, num_draft + 1):
        reached = (proposed >= k) & (accepted >= k - 1)
        num_reached = int(reached.sum())
        hit = int(((accepted >= k) & reached).sum())
        position_acceptance.append(hit / num_reached if num_reached else 0.0)
    return RoundStats(
        num_rounds=len(rounds),
        num_emitted=int((accepted + 1).sum()),
        mean_accepted_len=float((accepted + 1).mean()),
        mean_accepted_drafts=float(accepted.mean()),
        proposal_rate=float((proposed > 0).mean()),
        position_acceptance=position_acceptance,
    )


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, input_ids: torch.Tensor, num_new: int, stop_ids: Sequence[int] = ()
) -> torch.Tensor:
    """input_ids [B, P] -> generated [B, num_new] (greedy; rows past a stop repeat the stop)."""
    seqs = input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    stops = torch.tensor(list(stop_ids), dtype=seqs.dtype, device=seqs.device)
    for _ in range(num_new):
        next_ids = model(seqs)[:, -1].argmax(-1)  # [B]
        if len(stop_ids):
            next_ids = torch.where(done, seqs[:, -1], next_ids)
            done |= torch.isin(next_ids, stops)
        seqs = torch.cat([seqs, next_ids[:, None]], dim=1)
    return seqs[:, input_ids.shape[1] :]


@torch.no_grad()
def draft_chains(
    draft: torch.nn.Module, seqs: torch.Tensor, prompt_len: int, num_gen: int, num_draft: int
) -> torch.Tensor:
    """The draft's greedy chain after every generated prefix.

    seqs [B, prompt_len + num_gen + num_draft] (prompt + target reference) ->
    chains [B, num_gen, num_draft]: chains[b, i] is proposed from seqs[b, :prompt_len + i]."""
    chains = []
    for i in range(num_gen):
        chains.append(greedy_generate(draft, seqs[:, : prompt_len + i], num_draft))
    return torch.stack(chains, dim=1)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, tokens: np.ndarray, window: int, batch_size: int, device
) -> tuple[float, int]:
    """exp(mean next-token CE) over non-overlapping windows of a token stream; (ppl, tokens)."""
    num_windows = (len(tokens) - 1) // window
    total_loss, total_count = 0.0, 0
    for start in range(0, num_windows, batch_size):
        rows = range(start, min(start + batch_size, num_windows))
        chunk = np.stack([tokens[r * window : r * window + window + 1] for r in rows])
        ids = torch.from_numpy(chunk.astype(np.int64)).to(device)  # [b, window + 1]
        logits = model(ids[:, :-1]).float()  # [b, window, V]
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total_loss += float(loss)
        total_count += ids[:, 1:].numel()
    return float(np.exp(total_loss / max(total_count, 1))), total_count


def pick_prompts(
    tokens: np.ndarray, num_prompts: int, prompt_len: int, span: int, seed: int, stop_id: int
) -> np.ndarray:
    """num_prompts windows [prompt_len] from a token stream, each followed by `span` tokens of
    the same document (no document separator inside prompt + span)."""
    rng = np.random.default_rng(seed)
    picked: list[np.ndarray] = []
    total = prompt_len + span
    for _ in range(200 * num_prompts):
        start = int(rng.integers(0, len(tokens) - total))
        window = tokens[start : start + total]
        if not (window == stop_id).any():
            picked.append(window[:prompt_len])
            if len(picked) == num_prompts:
                break
    return np.stack(picked).astype(np.int64)  # [num_prompts, prompt_len]


@torch.no_grad()
def measure_acceptance(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: torch.Tensor,
    num_gen: int,
    depth: int,
) -> dict:
    """Mean accepted length at `depth` (depth - 1 drafts) of the ngram and draft-model drafters
    against the target's greedy continuation of each prompt [B, P]."""
    num_draft = depth - 1
    prompt_len = prompts.shape[1]
    reference = greedy_generate(target, prompts, num_gen + num_draft)  # [B, G + d]
    seqs = torch.cat([prompts, reference], dim=1)
    chains = draft_chains(draft, seqs, prompt_len, num_gen, num_draft).cpu().numpy()
    seqs_np = seqs.cpu().numpy()
    ref_np = reference.cpu().numpy()
    ngram_rounds, draft_rounds = [], []
    for b in range(seqs_np.shape[0]):
        row = seqs_np[b].tolist()
        ngram_rounds += simulate_rounds(
            ref_np[b].tolist(),
            num_gen,
            num_draft,
            lambda i, row=row: ngram_propose(row[: prompt_len + i], num_draft),
        )
        draft_rounds += simulate_rounds(
            ref_np[b].tolist(), num_gen, num_draft, lambda i, b=b: chains[b, i].tolist()
        )
    return {
        "depth": depth,
        "num_prompts": int(prompts.shape[0]),
        "prompt_len": prompt_len,
        "num_gen": num_gen,
        "ngram": summarize_rounds(ngram_rounds, num_draft).as_dict(),
        "draft-model": summarize_rounds(draft_rounds, num_draft).as_dict(),
    }
