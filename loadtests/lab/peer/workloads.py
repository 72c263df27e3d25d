"""The two workloads' requests as token ids, the same for both engines (seeded; standard library
only, so the vLLM child needs nothing of the project's engine).

- wave: C requests at once, prompt lengths uniform in `wave_prompt_len`;
- chat: `max(chat_waves * C, chat_min_requests)` requests kept C live (a finished one is
  replaced at once), prompt and output lengths lognormal (median, sigma) clipped to [lo, hi],
  every prompt its own random tokens, so no two share a prefix;
- multiturn: `max(mt_waves * C, mt_min_conversations)` conversations kept C live, each
  `mt_turns` turns over one system prompt all of them share; turn t's prompt is the system
  prompt, every earlier turn's user message and reply, and its own user message. The replies
  in the history are fixed tokens of the reply's length (not what an engine said), so both
  engines see the same prompts and a turn's prompt extends the one before it.
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


def multiturn_lens(cfg: PeerConfig, c: int) -> list[list[tuple[int, int]]]:
    """Per conversation at concurrency `c`, per turn: (user message length, reply length)."""
    rng = random.Random(cfg.seed * 104_729 + c)
    num = max(cfg.mt_waves * c, cfg.mt_min_conversations)
    return [
        [(_lognormal(rng, cfg.mt_user_len), _lognormal(rng, cfg.mt_output_len)) for _ in turns]
        for turns in [range(cfg.mt_turns)] * num
    ]


def multiturn_requests(cfg: PeerConfig, c: int, vocab: int) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: (prompt ids, max_tokens); prompts as the module says."""
    rng = random.Random(cfg.seed * 104_729 + c + 500_000)
    system = _tokens(rng, cfg.mt_system_len, vocab)
    conversations = []
    for turns in multiturn_lens(cfg, c):
        history, requests = list(system), []
        for user_len, reply_len in turns:
            history += _tokens(rng, user_len, vocab)
            requests.append((list(history), reply_len))
            history += _tokens(rng, reply_len, vocab)
        conversations.append(requests)
    return conversations
