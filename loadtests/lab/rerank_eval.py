"""Own-start evaluation of the block-drafter re-ranker (`executor/drafters/rerank.py`).

Each policy (re-ranker off: the drafter's top-1; on: the re-ranker's choice) walks its own
greedy generation: a block is proposed after the committed text, verified by the target's greedy
continuation (accepted prefix, then the correction or bonus token), and the next block starts
after what it committed. Tokens per verify step (mean accepted + 1) therefore compare the two
as a server would see them; the re-ranker's host time per block is measured beside it.

    python -m loadtests.lab.rerank_eval [--texts 8] [--tokens 512] [--block 16] [--rank 3]

runs a synthetic stream (motif texts; the truth at the drafter's rank `--rank` with probability
`--shift`, else its top-1) and prints the table; `walk` and `compare` take any block drafter.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from executor.drafters.rerank import OnlineReranker

# context -> (cand_ids [B-1, k], cand_logits [B-1, k]), candidates in rank order
ProposeBlock = Callable[[list[int]], tuple[np.ndarray, np.ndarray]]
# (context, drafts) -> the target's greedy tokens after context: accepted drafts, then one more
TargetGreedy = Callable[[list[int], list[int]], list[int]]


def walk(
    propose_block: ProposeBlock,
    target_greedy: TargetGreedy,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    reranker: OnlineReranker | None = None,
    slot: int = 0,
) -> dict:
    """Greedy generation of `max_new_tokens` per prompt, one verify step per block; prompts run
    one after another in `slot`, the re-ranker's weights carrying over as in a server. Returns
    {"per_prompt": [...], "overall": {...}} with steps, tokens, tokens_per_step, rows,
    top1_changed_share, rerank_ms_per_block and extend_ms_per_block (host time of the
    re-ranker's choice and of its index update + training)."""
    per_prompt = []
    for prompt in prompts:
        context = list(prompt)
        if reranker is not None:
            reranker.start(slot, context)
        steps = tokens = rows = changed = 0
        rerank_s = extend_s = 0.0
        while tokens < max_new_tokens:
            cand_ids, cand_logits = propose_block(context)  # [B-1, k] each
            cand_ids = np.asarray(cand_ids, dtype=np.int64)
            top1 = cand_ids[:, 0]  # [B-1]
            if reranker is None:
                drafts = top1
            else:
                t0 = time.perf_counter()
                drafts = reranker.rerank([slot], cand_ids[None], np.asarray(cand_logits)[None])[0]
                rerank_s += time.perf_counter() - t0
            drafts = drafts.tolist()
            out = list(target_greedy(context, drafts))
            num_accepted = len(out) - 1
            if not 0 <= num_accepted <= len(drafts) or out[:num_accepted] != drafts[:num_accepted]:
                raise ValueError(f"target_greedy returned {out} for drafts {drafts}")
            out = out[: max_new_tokens - tokens]
            context += out
            if reranker is not None:
                t0 = time.perf_counter()
                reranker.extend(slot, out)
                extend_s += time.perf_counter() - t0
            steps, tokens = steps + 1, tokens + len(out)
            rows += len(drafts)
            changed += int((np.asarray(drafts) != top1).sum())
        if reranker is not None:
            reranker.release(slot)
        per_prompt.append(_summary(steps, tokens, rows, changed, rerank_s, extend_s))
    totals = [sum(p[key] for p in per_prompt) for key in ("steps", "tokens", "rows")]
    changed = sum(p["top1_changed_share"] * p["rows"] for p in per_prompt)
    rerank_s = sum(p["rerank_ms_per_block"] * p["steps"] for p in per_prompt) / 1e3
    extend_s = sum(p["extend_ms_per_block"] * p["steps"] for p in per_prompt) / 1e3
    overall = _summary(*totals, round(changed), rerank_s, extend_s)
    return {"per_prompt": per_prompt, "overall": overall}


def _summary(steps, tokens, rows, changed, rerank_s, extend_s) -> dict:
    return {
        "steps": steps,
        "tokens": tokens,
        "tokens_per_step": tokens / max(steps, 1),
        "rows": rows,
        "top1_changed_share": changed / max(rows, 1),
        "rerank_ms_per_block": 1e3 * rerank_s / max(steps, 1),
        "extend_ms_per_block": 1e3 * extend_s / max(steps, 1),
    }


def compare(
    propose_block: ProposeBlock,
    target_greedy: TargetGreedy,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    reranker: OnlineReranker,
) -> dict:
    """Both policies over the same prompts: {"off": walk(...), "on": walk(..., reranker)}."""
    return {
        "off": walk(propose_block, target_greedy, prompts, max_new_tokens),
        "on": walk(propose_block, target_greedy, prompts, max_new_tokens, reranker),
    }


def format_report(reports: dict) -> str:
    """A table of `compare`'s result: one line per prompt and policy, then the overall ones."""
    head = f"{'prompt':>7} {'policy':>6} {'steps':>6} {'tok/step':>9} {'changed':>8} {'ms/blk':>7}"
    lines = [head]
    for name, rep in reports.items():
        rows = [*enumerate(rep["per_prompt"]), ("all", rep["overall"])]
        for i, p in rows:
            ms = p["rerank_ms_per_block"] + p["extend_ms_per_block"]
            lines.append(
                f"{i!s:>7} {name:>6} {p['steps']:>6} {p['tokens_per_step']:>9.3f} "
                f"{p['top1_changed_share']:>8.3f} {ms:>7.3f}"
            )
    return "\n".join(lines)


# -- a synthetic stream: texts that repeat with variations, and a drafter that misranks --------
@dataclass
class ToyStream:
    """Texts whose greedy "target" is the text itself, and per text position the drafter's k
    candidates (the same whichever block start reaches the position)."""

    texts: list[list[int]]
    prompt_len: int
    block_rows: int  # B - 1
    cand_ids: list[np.ndarray]  # per text [len, k] int64
    cand_logits: list[np.ndarray]  # per text [len, k] float32
    truth_rank: list[np.ndarray]  # per text [len] int64, -1: the truth is not a candidate
    _by_prompt: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_prompt = {tuple(t[: self.prompt_len]): i for i, t in enumerate(self.texts)}

    def prompts(self) -> list[list[int]]:
        return [t[: self.prompt_len] for t in self.texts]

    def _text(self, context: Sequence[int]) -> int:
        return self._by_prompt[tuple(context[: self.prompt_len])]

    def propose_block(self, context: list[int]) -> tuple[np.ndarray, np.ndarray]:
        i, pos = self._text(context), len(context)
        end = pos + self.block_rows
        return self.cand_ids[i][pos:end], self.cand_logits[i][pos:end]

    def target_greedy(self, context: list[int], drafts: list[int]) -> list[int]:
        text, pos = self.texts[self._text(context)], len(context)
        out = []
        for j, draft in enumerate(drafts):
            out.append(text[pos + j])
            if draft != out[-1]:
                return out
        return [*out, text[pos + len(drafts)]]


def motif_text(
    rng: np.random.Generator, length: int, vocab: int, num_motifs: int, mutate: float
) -> list[int]:
    """Random phrases (4..12 tokens over `vocab`) strung together at random, each token replaced
    by a random one with probability `mutate`: most tokens continue an n-gram seen before."""
    motifs = [rng.integers(0, vocab, int(rng.integers(4, 13))) for _ in range(num_motifs)]
    parts, total = [], 0
    while total < length:
        part = motifs[int(rng.integers(num_motifs))].copy()
        noisy = rng.random(len(part)) < mutate
        part[noisy] = rng.integers(0, vocab, int(noisy.sum()))
        parts.append(part)
        total += len(part)
    return np.concatenate(parts)[:length].tolist()


def make_toy_stream(
    seed: int = 0,
    num_texts: int = 4,
    prompt_len: int = 256,
    max_new_tokens: int = 512,
    block_rows: int = 15,
    k: int = 16,
    vocab: int = 256,
    num_motifs: int = 24,
    mutate: float = 0.02,
    rank_probs: dict[int, float] | None = None,
) -> ToyStream:
    """A stream whose truth sits at drafter rank r with probability rank_probs[r] (-1: not among
    the candidates; the rest of the mass: rank 0). The other candidates are distinct random
    tokens of the same vocabulary; logits fall with rank."""
    rng = np.random.default_rng(seed)
    rank_probs = rank_probs or {}
    ranks = [*rank_probs, 0]
    probs = [*rank_probs.values(), 1.0 - sum(rank_probs.values())]
    length = prompt_len + max_new_tokens + block_rows + 1
    texts, all_ids, all_logits, all_ranks = [], [], [], []
    for _ in range(num_texts):
        text = motif_text(rng, length, vocab, num_motifs, mutate)
        truth_rank = rng.choice(ranks, size=length, p=probs)  # [len]
        ids = np.empty((length, k), dtype=np.int64)  # [len, k]
        for pos, (tok, r) in enumerate(zip(text, truth_rank.tolist())):
            others = rng.choice(vocab - 1, size=k, replace=False)
            others[others >= tok] += 1  # distinct, never the truth
            if r >= 0:
                others[r] = tok
            ids[pos] = others
        steps = rng.exponential(0.5, size=(length, k)).astype(np.float32)  # [len, k]
        logits = 8.0 - np.cumsum(steps, axis=1)  # [len, k] descending
        texts.append(text)
        all_ids.append(ids)
        all_logits.append(logits)
        all_ranks.append(truth_rank)
    return ToyStream(texts, prompt_len, block_rows, all_ids, all_logits, all_ranks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rerank_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512, help="new tokens per text")
    ap.add_argument("--block", type=int, default=16, help="block size B (B-1 draft rows)")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--rank", type=int, default=3, help="the drafter's rank of a shifted truth")
    ap.add_argument("--shift", type=float, default=0.3, help="share of positions shifted")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--train-rows", choices=("all", "until_miss"), default="all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    stream = make_toy_stream(
        seed=args.seed,
        num_texts=args.texts,
        prompt_len=args.prompt_len,
        max_new_tokens=args.tokens,
        block_rows=args.block - 1,
        k=args.k,
        rank_probs={args.rank: args.shift},
    )
    reranker = OnlineReranker(k=args.k, lr=args.lr, train_rows=args.train_rows)
    reports = compare(
        stream.propose_block, stream.target_greedy, stream.prompts(), args.tokens, reranker
    )
    print(format_report(reports))
    stats = reranker.stats()
    print(
        f"learner: rows trained {stats['rows_trained']}, top-1 acc {stats['top1_acc']:.3f}, "
        f"chosen acc {stats['chosen_acc']:.3f}, not in top-k {stats['not_in_topk_share']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
