"""The two workloads' requests as token ids, the same for both engines (seeded; standard library
only, so the vLLM child needs nothing of the project's engine).

- wave: C requests at once, prompt lengths uniform in `wave_prompt_len`;
- chat: `max(chat_waves * C, chat_min_requests)` requests kept C live (a finished one is
  replaced at once), prompt and output lengths lognormal (median, sigma) clipped to [lo, hi],
  every prompt its own random tokens, so no two share a prefix.
Lengths come from their own generator, so the roofline can be computed without the tokens."""

from __future__ import annotations

import math
import random

from loadtests.lab.peer.config import PeerConfig

# Token ids are drawn in [LOW_ID, min(vocab, HIGH_ID)): clear of the ids special tokens take at
# both ends of real vocabularies.
LOW_ID, HIGH_ID = 10, 150_000


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    hi = min(vocab, HIGH_ID)
    return [rng.randrange(LOW_ID, hi) for _ in range(n)]


def wave_lens(cfg: PeerConfig, c: int, seed_offset: int = 0) -> list[int]:
    rng = random.Random((cfg.seed + seed_offset) * 1000 + c)
    lo, hi = cfg.wave_prompt_len
    return [rng.randint(lo, hi) for _ in range(c)]


def wave_prompts(cfg: PeerConfig, c: int, vocab: int, seed_offset: int = 0) -> list[list[int]]:
    rng = random.Random((cfg.seed + seed_offset) * 1000 + c + 500_000)
    return [_tokens(rng, n, vocab) for n in wave_lens(cfg, c, seed_offset)]


def _lognormal(rng: random.Random, spec: tuple) -> int:
    median, sigma, lo, hi = spec
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def chat_lens(cfg: PeerConfig, c: int) -> list[tuple[int, int]]:
    """(prompt length, output length) of each chat request at concurrency `c`, in order."""
    rng = random.Random(cfg.seed * 7919 + c)
    num = max(cfg.chat_waves * c, cfg.chat_min_requests)
    return [
        (_lognormal(rng, cfg.chat_prompt_len), _lognormal(rng, cfg.chat_output_len))
        for _ in range(num)
    ]


def chat_requests(cfg: PeerConfig, c: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of each chat request at concurrency `c`, in order."""
    rng = random.Random(cfg.seed * 7919 + c + 500_000)
    return [(_tokens(rng, p, vocab), m) for p, m in chat_lens(cfg, c)]
