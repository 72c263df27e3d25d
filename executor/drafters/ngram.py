"""Prompt-lookup drafting: find the longest recent n-gram of the context's suffix earlier in the
context and propose the tokens that followed it. No model, no device work."""

from __future__ import annotations

from executor.drafters.base import DraftBatch, DraftRequest


def ngram_propose(context: list[int], num_draft: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Longest suffix match (n from max_n down to min_n), most recent occurrence first. Returns up
    to num_draft tokens (may be fewer when the match sits near the end); empty when no match."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        # scan backwards for the latest earlier occurrence of the suffix
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + num_draft]
                if follow:
                    return follow
    return []


class NgramDrafter:
    name = "ngram"
    has_probs = False

    def __init__(self, min_n: int = 1, max_n: int = 4, lookback: int = 2048):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback

    def setup(self, slot: int, context: list[int]) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def propose(self, requests: list[DraftRequest], greedy: list[bool]) -> DraftBatch:
        tokens = []
        for r in requests:
            window = r.context[-self.lookback :]
            proposal = ngram_propose(window, r.num_draft, self.min_n, self.max_n)
            # The verify pass has a fixed shape per request: pad a short proposal by repeating
            # its last token (or the context's); padded positions are simply likely rejected.
            filler = proposal[-1] if proposal else r.context[-1]
            tokens.append(proposal + [filler] * (r.num_draft - len(proposal)))
        return DraftBatch(tokens=tokens)

    def commit(self, slot: int, context: list[int], num_accepted: int, num_draft: int) -> None:
        pass
