"""Online re-ranking of a block drafter's top-k candidates, trained on verified text (host, numpy).

A block drafter scores the vocabulary at each of a block's R draft rows; the top k per row (ids
in rank order, logits) come to the host. For greedy requests the re-ranker picks one candidate
per row by a linear score w . f(row, candidate), one weight vector per drafter shared by all its
requests. Verification is unchanged: a choice only moves acceptance, never the output. Sampled
requests keep the drafter's own draws, since rejection sampling needs the true draft distribution.

Learning: row j of a block proposed after L committed tokens predicts the token at L + j. Once
the committed text covers a block, each row whose true token is among its k candidates takes a
softmax-over-candidates cross-entropy step (Adagrad). The initial weights score by the drafter's
logit gap alone, so the choice is the drafter's top-1 and the softmax is the drafter's own
distribution over its top k: "on" starts identical to "off".
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

NGRAM_ORDERS = 4  # continuations `prefix[-o:] + candidate` for o = 0..3 (n-grams, n = 1..4)
LONG_MATCH = NGRAM_ORDERS  # suffix matches this long or longer come from the suffix automaton


def feature_names(k: int) -> list[str]:
    """Names of the feature vector's entries, in order. A constant bias and the raw logit are
    left out: both are the same for every candidate of a row, so they cancel in the softmax
    over its candidates (the rank one-hot is the per-candidate bias, the gap the logit)."""
    names = [f"rank_{r}" for r in range(k)]
    names += ["logit_gap", "rank_0_x_top1_prob", "is_prev_top1", "is_next_top1"]
    for o in range(NGRAM_ORDERS):  # ngram1 (o = 0) ignores the prefix: a static feature
        names += [f"ngram{o + 1}_seen", f"ngram{o + 1}_log_count", f"ngram{o + 1}_share"]
    names += ["suffix_log_len", "suffix_longest"]
    return names


class _Span:
    """Index of one contiguous span of a request's text: n-gram continuation counts and a suffix
    automaton, both grown one token at a time (amortised O(1) per token).

    `ngram[context]` maps each following token to its count, key -1 to the context's total,
    for contexts of 0..3 tokens. The automaton's state u stands for a set of substrings sharing
    their end positions; `nxt[u]` holds the tokens that follow them, `link[u]` the state of
    their longest suffix outside the set, `length[u]` the longest substring's length."""

    def __init__(self, start: int):
        self.start = start  # absolute position of the span's first token
        self.ngram: dict[tuple[int, ...], dict[int, int]] = {}
        self.hist: list[int] = []  # the span's last NGRAM_ORDERS - 1 tokens
        self.nxt: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.last = 0  # state of the whole span

    @property
    def size(self) -> int:
        return self.length[self.last]

    def add(self, tok: int) -> None:
        hist, ngram = self.hist, self.ngram
        for o in range(len(hist) + 1):
            key = tuple(hist[len(hist) - o :])
            follow = ngram.get(key)
            if follow is None:
                follow = ngram[key] = {-1: 0}
            follow[-1] += 1
            follow[tok] = follow.get(tok, 0) + 1
        hist.append(tok)
        if len(hist) == NGRAM_ORDERS:
            del hist[0]
        # suffix automaton extension (Blumer et al.)
        nxt, link, length = self.nxt, self.link, self.length
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][tok]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of `tokens` that occurs in the span."""
        nxt, link, length = self.nxt, self.link, self.length
        u = matched = 0
        for t in tokens:
            while u and t not in nxt[u]:
                u = link[u]
                matched = length[u]
            if t in nxt[u]:
                u, matched = nxt[u][t], matched + 1
        return u, matched

    def snapshot(self) -> tuple:
        return (self.start, self.ngram, self.hist, self.nxt, self.link, self.length, self.last)


class TextIndex:
    """A request's committed text and the index over its recent part.

    Memory stays bounded by indexing spans that start at multiples of `window`: the current span
    (queried) covers the last `window` to 2 * `window` tokens, the next one grows beside it from
    the latest multiple and replaces it at the following one. The state is a function of the
    text alone (any chunking of `extend` gives the same), and a long extend indexes only the
    tokens the final spans cover."""

    def __init__(self, window: int = 2048):
        self.window = window
        self.text = array("q")
        self.cur: _Span | None = _Span(0)
        self.next: _Span | None = None

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, tokens: Sequence[int]) -> None:
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        pos, end, window = len(self.text), len(self.text) + len(tokens), self.window
        self.text.extend(tokens)
        first = max(0, ((end - 1) // window - 1) * window)  # the final current span's start
        if pos < first:  # everything before `first` is left out of the final spans
            tokens, pos, self.cur, self.next = tokens[first - pos :], first, None, None
        for tok in tokens:
            if pos and pos % window == 0:
                if self.next is not None:
                    self.cur = self.next
                self.next = _Span(pos)
            if self.cur is not None:
                self.cur.add(tok)
            if self.next is not None:
                self.next.add(tok)
            pos += 1

    def snapshot(self) -> tuple:
        spans = tuple(s.snapshot() if s else None for s in (self.cur, self.next))
        return (self.text.tolist(), *spans)


@dataclass
class _Block:
    start: int  # absolute position row 0 predicts
    cand_rows: list[list[int]]  # [R][k] the candidates
    chosen: list[int]  # [R]
    static: np.ndarray  # [R, k, num_static] float32 (a view into the batch's array)
    # the prefix-dependent evidence, sparse: (row, candidate, context length, count, total)
    ngram_hits: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (row, candidate, suffix length, 1 if the row's longest else 0)
    suffix_hits: list[tuple[int, int, int, int]] = field(default_factory=list)


class OnlineReranker:
    """Re-ranks block-drafter candidates per request slot and learns from committed text.

    Protocol per slot: `start` (prompt), then per speculating round `sync` (or `extend`) with
    the committed text, `rerank` for the greedy requests, and `extend` / `sync` again as tokens
    commit (any round kind); `release` at the end. Training happens inside `extend` once the text
    covers a remembered block. `train_rows`: "all" trains on every covered row; "until_miss"
    only on rows up to the block's first wrong choice, whose n-gram features saw the true prefix.
    `train_batch`: rows per Adagrad step (covered rows queue up to it, which keeps the numpy
    overhead per step off each block). `max_walk` bounds the suffix-link steps per row."""

    def __init__(
        self,
        k: int = 16,
        lr: float = 0.3,
        window: int = 2048,
        train_rows: str = "all",
        max_walk: int = 16,
        train_batch: int = 32,
    ):
        if train_rows not in ("all", "until_miss"):
            raise ValueError(f"train_rows must be 'all' or 'until_miss', got {train_rows!r}")
        self.k, self.lr, self.window = k, lr, window
        self.train_rows, self.max_walk = train_rows, max_walk
        self.names = feature_names(k)
        self.num_static = k + 7  # drafter and neighbour features, then the unigram's
        self.dyn0 = self.num_static  # first prefix-dependent feature: ngram2_seen
        self.w = np.zeros(len(self.names))  # [F]
        self.w[k] = 1.0  # logit gap: the drafter's own scores
        self.g2 = np.zeros(len(self.names))  # [F] Adagrad's sum of squared gradients
        self._index: dict[int, TextIndex] = {}
        self._blocks: dict[int, deque[_Block]] = {}
        self._counts = dict.fromkeys(
            (
                "blocks",
                "rows_reranked",
                "rows_changed",
                "rows_covered",
                "rows_trained",
                "rows_not_in_topk",
                "truth_rank_sum",
                "top1_correct",
                "chosen_correct",
            ),
            0,
        )
        self._loss_sum = 0.0
        self.train_batch = train_batch
        self._ready: list[tuple[_Block, list[int], list[int]]] = []  # block, rows, true ranks
        self._ready_rows = 0

    # -- slots ---------------------------------------------------------------------------------
    def start(self, slot: int, context_tokens: Sequence[int]) -> None:
        """A request takes `slot` with its committed context (the prompt)."""
        self.release(slot)
        self._index[slot] = TextIndex(self.window)
        self._blocks[slot] = deque()
        self.extend(slot, context_tokens)

    def extend(self, slot: int, new_tokens: Sequence[int]) -> None:
        """Committed tokens appended; trains on the blocks the text now covers."""
        index = self._index[slot]
        index.extend(new_tokens)
        blocks = self._blocks[slot]
        while blocks and blocks[0].start + len(blocks[0].chosen) <= len(index):
            self._cover(blocks.popleft(), index)

    def sync(self, slot: int, context: Sequence[int]) -> None:
        """Brings the slot up to `context` (the executor's committed context): appends what is
        new; a context shorter than the slot's text restarts the slot."""
        known = len(self._index[slot])
        if len(context) < known:
            self.start(slot, context)
        elif len(context) > known:
            self.extend(slot, context[known:])

    def release(self, slot: int) -> None:
        """Trains on the rows the text covers of the slot's remaining blocks, then forgets it."""
        index, blocks = self._index.pop(slot, None), self._blocks.pop(slot, None)
        for block in blocks or ():
            if block.start < len(index):
                self._cover(block, index)

    def index(self, slot: int) -> TextIndex:
        return self._index[slot]

    def num_pending(self, slot: int) -> int:
        return len(self._blocks[slot])

    # -- choosing ------------------------------------------------------------------------------
    def static_features(
        self,
        cand_ids: np.ndarray,  # [n, R, k] int64
        cand_logits: np.ndarray,  # [n, R, k] float
        last_tokens: np.ndarray,  # [n] int64, each request's last committed token
        unigram: np.ndarray,  # [n, R, k] int64, each candidate's count in its request's span
        span_len: np.ndarray,  # [n] int64, tokens in each request's span
        num_rows: np.ndarray,  # [n] int64, rows in use per request
    ) -> np.ndarray:
        """The features that do not depend on the chosen prefix, [n, R, k, num_static]."""
        n, rows_max, k = cand_ids.shape
        x = np.zeros((n, rows_max, k, self.num_static), dtype=np.float32)
        x[..., :k] = np.eye(k, dtype=np.float32)
        logits = cand_logits.astype(np.float32)
        gap = np.maximum(logits - logits.max(axis=-1, keepdims=True), -30.0)  # [n, R, k]
        x[..., k] = gap
        x[..., 0, k + 1] = 1.0 / np.exp(gap).sum(axis=-1)  # top-1 share of the top-k softmax
        prev_top = np.empty((n, rows_max), dtype=np.int64)  # [n, R]
        prev_top[:, 0] = last_tokens
        prev_top[:, 1:] = cand_ids[:, :-1, 0]
        next_top = np.full((n, rows_max), -1, dtype=np.int64)  # [n, R]
        next_top[:, :-1] = cand_ids[:, 1:, 0]
        next_top[np.arange(rows_max)[None] >= num_rows[:, None] - 1] = -1  # no row after the last
        x[..., k + 2] = cand_ids == prev_top[..., None]
        x[..., k + 3] = cand_ids == next_top[..., None]
        x[..., k + 4] = unigram > 0
        x[..., k + 5] = np.log1p(unigram)
        x[..., k + 6] = unigram / np.maximum(span_len, 1)[:, None, None]
        return x

    def rerank(
        self,
        slots: Sequence[int],
        cand_ids: np.ndarray,  # [n, R, k] int, rank order (the drafter's top-1 first)
        cand_logits: np.ndarray,  # [n, R, k] float
        num_rows: Sequence[int] | None = None,  # [n] rows in use per request (default R)
    ) -> np.ndarray:
        """Chosen ids [n, R], one of each row's candidates; row j of request i drafts the token
        after slot i's committed text and rows 0..j-1. Rows past num_rows[i] (padding) return
        their top-1 and are not learned from. Remembers each block for training."""
        cand_ids = np.asarray(cand_ids, dtype=np.int64)
        n, rows_max, k = cand_ids.shape
        if k != self.k:
            raise ValueError(f"expected {self.k} candidates per row, got {k}")
        used = [rows_max] * n if num_rows is None else [int(r) for r in num_rows]
        if len(used) != n or not all(0 <= r <= rows_max for r in used):
            raise ValueError(f"num_rows {used} does not fit {n} requests of {rows_max} rows")
        if not rows_max:
            return cand_ids[..., 0]
        indexes = [self._index[s] for s in slots]
        last = np.array([ix.text[-1] if len(ix) else -1 for ix in indexes], dtype=np.int64)
        ids_rows = cand_ids.tolist()
        unigram = np.array(  # [n, R, k]
            [
                [[counts.get(c, 0) for c in row] for row in rows]
                for counts, rows in zip((ix.cur.ngram.get((), {}) for ix in indexes), ids_rows)
            ],
            dtype=np.int64,
        ).reshape(n, rows_max, k)
        span_len = np.array([ix.cur.size for ix in indexes], dtype=np.int64)  # [n]
        static = self.static_features(
            cand_ids, np.asarray(cand_logits), last, unigram, span_len, np.array(used)
        )
        base = static @ self.w[: self.num_static].astype(np.float32)  # [n, R, k]
        picks = base.argmax(axis=-1).tolist()  # [n][R]
        chosen = cand_ids[..., 0].copy()  # [n, R]
        for i, slot in enumerate(slots):
            r = used[i]
            block = _Block(len(indexes[i]), ids_rows[i][:r], [], static[i, :r])
            chosen[i, :r] = self._choose(
                indexes[i], ids_rows[i][:r], base[i, :r].tolist(), picks[i], block
            )
            blocks = self._blocks[slot]
            if blocks and blocks[-1].start == block.start:
                blocks.pop()  # a re-proposal from the same start supersedes the earlier one
            if r:
                blocks.append(block)
        c = self._counts
        c["blocks"] += n
        c["rows_reranked"] += sum(used)
        c["rows_changed"] += int((chosen != cand_ids[..., 0]).sum())
        return chosen

    def _choose(
        self,
        index: TextIndex,
        ids: list[list[int]],  # [R][k]
        scores: list[list[float]],  # [R][k] the static part of the score
        static_pick: list[int],  # [R] each row's best by the static part (first on ties)
        block: _Block,
    ) -> list[int]:
        """Picks row by row: a row's n-gram and suffix features follow the rows chosen before."""
        span, k = index.cur, self.k
        w = self.w[self.dyn0 :].tolist()
        w_seen, w_log, w_share, (w_suffix, w_longest) = w[0:9:3], w[1:9:3], w[2:9:3], w[9:]
        ngram_hits, suffix_hits = block.ngram_hits, block.suffix_hits
        nxt, link, length = span.nxt, span.link, span.length
        tail = index.text[-(LONG_MATCH - 1) :].tolist()
        state, matched = span.last, span.size
        for j, cands in enumerate(ids):
            s = scores[j]
            best: dict[int, int] = {}  # candidate -> the longest prefix suffix it follows
            col = {c: ci for ci, c in enumerate(cands)}
            for o in range(1, len(tail) + 1):
                follow = span.ngram.get(tuple(tail[len(tail) - o :]))
                if follow is None:
                    break  # a longer context was never seen either
                total = follow[-1]
                if len(follow) <= k:  # the -1 key (the total) is no candidate
                    hits = [(col[c], count) for c, count in follow.items() if c in col]
                else:
                    hits = [(ci, follow[c]) for ci, c in enumerate(cands) if c in follow]
                seen, log, share = w_seen[o - 1], w_log[o - 1], w_share[o - 1]
                for ci, count in hits:
                    s[ci] += seen + log * math.log1p(count) + share * count / total
                    ngram_hits.append((j, ci, o, count, total))
                    best[ci] = o
            # Long matches: down the suffix links from the prefix's state while they are long.
            found: dict[int, tuple[int, int]] = {}  # token -> (suffix length, state)
            u, u_len, steps, cut = state, matched, 0, False
            if u_len >= LONG_MATCH:
                todo = set(cands)
                while u > 0 and u_len >= LONG_MATCH and todo:
                    if steps == self.max_walk:
                        cut = True
                        break
                    trans = nxt[u]
                    for t in [t for t in trans if t in todo] if len(trans) < len(todo) else todo:
                        if t in trans:
                            found[t] = (u_len, u)
                    todo.difference_update(found)
                    u = link[u]
                    u_len, steps = length[u], steps + 1
                for t, (m, _) in found.items():
                    best[col[t]] = m
            if best:
                top = max(best.values())
                for ci, m in best.items():
                    longest = int(m == top)
                    s[ci] += w_suffix * math.log1p(m) + w_longest * longest
                    suffix_hits.append((j, ci, m, longest))
                pick = max(range(k), key=s.__getitem__)  # ties: the better drafter rank
            else:
                pick = static_pick[j]
            tok = cands[pick]
            block.chosen.append(tok)
            tail.append(tok)
            # The prefix's automaton state after `tok`: from the walk when it found it; else
            # its match is at most LONG_MATCH long (unless the walk was cut): re-match the tail.
            if tok in found:
                u_len, u = found[tok]
                state, matched = nxt[u][tok], u_len + 1
            elif cut:
                state, matched = span.match((index.text[-64:].tolist() + block.chosen)[-64:])
            else:
                state, matched = span.match(tail)
            del tail[: len(tail) - (LONG_MATCH - 1)]
        return block.chosen

    # -- learning ------------------------------------------------------------------------------
    def _cover(self, block: _Block, index: TextIndex) -> None:
        """Scores the block's choices against the committed text and queues its rows whose true
        token is a candidate (with "until_miss": up to the first wrong choice) for training."""
        num_rows = min(len(block.chosen), len(index) - block.start)
        truth = index.text[block.start : block.start + num_rows].tolist()  # [r]
        rows, targets = [], []
        c, miss = self._counts, False
        for j, (tok, cands, pick) in enumerate(zip(truth, block.cand_rows, block.chosen)):
            if tok in cands:
                rank = cands.index(tok)
                c["truth_rank_sum"] += rank
                c["top1_correct"] += rank == 0
                if not (miss and self.train_rows == "until_miss"):
                    rows.append(j)
                    targets.append(rank)
            else:
                c["rows_not_in_topk"] += 1
            c["chosen_correct"] += pick == tok
            miss = miss or pick != tok
        c["rows_covered"] += num_rows
        if rows:
            self._ready.append((block, rows, targets))
            self._ready_rows += len(rows)
            if self._ready_rows >= self.train_batch:
                self._step()

    def _dense(self, items: Sequence[tuple[_Block, Sequence[int]]]) -> np.ndarray:
        """Feature vectors [m, k, F] of the given rows of the given blocks, in order."""
        d0 = self.dyn0
        at: dict[tuple[int, int], int] = {}  # (item, row) -> row of x
        statics, ngram_hits, suffix_hits = [], [], []
        for b, (block, rows) in enumerate(items):
            for j in rows:
                at[b, j] = len(at)
            statics.append(block.static[list(rows)])
            ngram_hits += [(at[b, h[0]], *h[1:]) for h in block.ngram_hits if (b, h[0]) in at]
            suffix_hits += [(at[b, h[0]], *h[1:]) for h in block.suffix_hits if (b, h[0]) in at]
        x = np.zeros((len(at), self.k, len(self.w)), dtype=np.float32)  # [m, k, F]
        if not at:
            return x
        x[..., : self.num_static] = np.concatenate(statics)
        if ngram_hits:
            row, ci, o, count, total = np.array(ngram_hits, dtype=np.int64).T  # [h] each
            f = d0 + 3 * (o - 1)
            x[row, ci, f] = 1.0
            x[row, ci, f + 1] = np.log1p(count)
            x[row, ci, f + 2] = count / total
        if suffix_hits:
            row, ci, m, longest = np.array(suffix_hits, dtype=np.int64).T  # [h] each
            x[row, ci, d0 + 9] = np.log1p(m)
            x[row, ci, d0 + 10] = longest
        return x

    def block_features(self, slot: int, which: int = -1) -> np.ndarray:
        """Features [R, k, F] of one of the slot's remembered blocks (default: the latest), as
        its choice saw them; `feature_names` labels the last axis."""
        block = self._blocks[slot][which]
        return self._dense([(block, range(len(block.chosen)))])

    def _step(self) -> None:
        """One Adagrad step of the softmax-over-candidates cross entropy on the queued rows."""
        ready, self._ready, self._ready_rows = self._ready, [], 0
        x = self._dense([(block, rows) for block, rows, _ in ready])  # [m, k, F]
        targets = [t for _, _, block_targets in ready for t in block_targets]
        target = np.array(targets)  # [m]
        scores = x @ self.w  # [m, k]
        scores -= scores.max(axis=1, keepdims=True)
        log_p = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))  # [m, k]
        p = np.exp(log_p)
        every = np.arange(len(target))
        self._loss_sum -= float(log_p[every, target].sum())
        p[every, target] -= 1.0  # d loss / d scores
        grad = np.einsum("mk,mkf->f", p, x) / len(target)  # [F]
        self.g2 += grad * grad
        self.w -= self.lr * grad / (np.sqrt(self.g2) + 1e-8)
        self._counts["rows_trained"] += len(target)

    def stats(self) -> dict:
        """Counts and shares since construction: rows re-ranked and changed from the top-1, rows
        covered by committed text, trained, whose truth was not a candidate, accuracy of the
        top-1 and of the choice on covered rows, mean rank of the truth and mean loss."""
        c = dict(self._counts)
        covered, in_topk = c["rows_covered"], c["rows_covered"] - c["rows_not_in_topk"]
        c["top1_changed_share"] = c["rows_changed"] / max(c["rows_reranked"], 1)
        c["not_in_topk_share"] = c["rows_not_in_topk"] / max(covered, 1)
        c["top1_acc"] = c["top1_correct"] / max(covered, 1)
        c["chosen_acc"] = c["chosen_correct"] / max(covered, 1)
        c["mean_truth_rank"] = c["truth_rank_sum"] / max(in_topk, 1)
        c["mean_loss"] = self._loss_sum / max(c["rows_trained"], 1)
        return c

    def weights(self) -> dict[str, float]:
        return dict(zip(self.names, self.w.tolist()))
