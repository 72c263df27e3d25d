"""Prompt-lookup drafting: find the longest recent n-gram of the context's suffix earlier in the
context and propose the tokens that followed it. No model, no device work.

Each slot keeps its context in a growing numpy buffer (appended at commit), so a proposal is a
few vectorised comparisons over the look-back window instead of a Python scan."""

from __future__ import annotations

import numpy as np

from executor.drafters.base import DraftBatch, DraftRequest


def ngram_propose(
    context: np.ndarray, num_draft: int, min_n: int = 1, max_n: int = 4
) -> np.ndarray:
    """Longest suffix match (n from max_n down to min_n), most recent earlier occurrence first.
    Returns up to num_draft tokens (fewer when the match sits near the end; empty: no match)."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        num_starts = length - n  # candidate starts 0 .. length-n-1 (the suffix itself excluded)
        match = np.ones(num_starts, dtype=bool)
        for k in range(n):
            match &= context[k : k + num_starts] == suffix[k]
        starts = np.flatnonzero(match)
        if starts.size:
            follow = context[starts[-1] + n : starts[-1] + n + num_draft]
            if follow.size:
                return follow
    return context[:0]


class NgramDrafter:
    name = "ngram"
    has_probs = False

    def __init__(self, min_n: int = 1, max_n: int = 4, lookback: int = 2048):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback
        self._buf: dict[int, np.ndarray] = {}  # slot -> token buffer (capacity >= length)
        self._len: dict[int, int] = {}

    def _sync(self, slot: int, context: list[int]) -> np.ndarray:
        """The slot's buffer brought up to `context` (appending only what is new)."""
        buf, length = self._buf.get(slot), self._len.get(slot, 0)
        if buf is None or length > len(context):
            buf, length = np.empty(max(2 * len(context), 64), dtype=np.int64), 0
        if len(context) > len(buf):
            grown = np.empty(2 * len(context), dtype=np.int64)
            grown[:length] = buf[:length]
            buf = grown
        if len(context) > length:
            buf[length : len(context)] = context[length:]
        self._buf[slot], self._len[slot] = buf, len(context)
        return buf[: len(context)]

    def setup(self, slot: int, context: list[int]) -> None:
        self._buf.pop(slot, None)
        self._len.pop(slot, None)
        self._sync(slot, context)

    def release(self, slot: int) -> None:
        self._buf.pop(slot, None)
        self._len.pop(slot, None)

    def propose(
        self, requests: list[DraftRequest], greedy: list[bool], defer: bool = False
    ) -> DraftBatch:
        tokens = []
        for r in requests:
            window = self._sync(r.slot, r.context)[-self.lookback :]
            proposal = ngram_propose(window, r.num_draft, self.min_n, self.max_n).tolist()
            # The verify pass has a fixed shape per request: pad a short proposal by repeating
            # its last token (or the context's); padded positions are simply likely rejected.
            filler = proposal[-1] if proposal else r.context[-1]
            tokens.append(proposal + [filler] * (r.num_draft - len(proposal)))
        return DraftBatch(tokens=tokens)

    def commit(self, slot: int, context: list[int], num_accepted: int, num_draft: int) -> None:
        self._sync(slot, context)
