"""Multi-turn conversations: what each turn sends, built from the replies the server gave.

A conversation is scripted in advance (a system prompt and one user message per turn) and
grows as it runs: turn t sends the system prompt, every earlier user message each followed by
the assistant reply the server actually streamed for it, and turn t's user message. Each turn
therefore repeats the whole previous turn's prompt and reply as its prefix, which is what a
server's prefix cache can serve instead of computing it again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtests.words import distinct_texts


@dataclass(frozen=True)
class ConversationScript:
    conv_id: int
    system_prompt: str
    user_turns: tuple[str, ...]  # one user message per turn


@dataclass(frozen=True)
class MultiTurnConfig:
    num_conversations: int = 16
    num_turns: int = 4
    system_prompt_len: int = 512  # words (about tokens); 0: no system message
    user_len: int = 64  # words of each user message
    num_system_prompts: int = 0  # 0: every conversation has its own; K: K shared in turn

    def check(self) -> None:
        for name in ("num_conversations", "num_turns", "user_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("system_prompt_len", "num_system_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")


def build_scripts(cfg: MultiTurnConfig, seed: int) -> list[ConversationScript]:
    """Seeded scripts; every user message of the run is distinct from its first word on."""
    cfg.check()
    rng = random.Random(seed)
    num_systems = cfg.num_system_prompts or cfg.num_conversations
    if cfg.system_prompt_len:
        systems = distinct_texts(rng, num_systems, cfg.system_prompt_len)
    else:
        systems = [""] * num_systems
    users = distinct_texts(rng, cfg.num_conversations * cfg.num_turns, cfg.user_len)
    t = cfg.num_turns
    return [
        ConversationScript(c, systems[c % num_systems], tuple(users[c * t : (c + 1) * t]))
        for c in range(cfg.num_conversations)
    ]


class Conversation:
    """One conversation's history while it runs."""

    def __init__(self, script: ConversationScript) -> None:
        self.script = script
        self.history: list[dict] = (
            [{"role": "system", "content": script.system_prompt}] if script.system_prompt else []
        )
        self.num_done = 0  # turns whose reply is in the history

    @property
    def done(self) -> bool:
        return self.num_done == len(self.script.user_turns)

    @property
    def next_user(self) -> str:
        return self.script.user_turns[self.num_done]

    def next_messages(self) -> tuple[dict, ...]:
        """What the next turn sends: the history so far and the next user message."""
        if self.done:
            raise IndexError(f"conversation {self.script.conv_id} has no turn left")
        return (*(dict(m) for m in self.history), {"role": "user", "content": self.next_user})

    def add_reply(self, reply: str) -> None:
        """Records the next turn as sent, with the reply the server gave to it."""
        user = self.next_user
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        self.num_done += 1


def think_times(mean_s: float, num: int, rng: random.Random) -> list[float]:
    """Pauses before each turn after the first: exponential with mean `mean_s` (0: none)."""
    if mean_s < 0:
        raise ValueError(f"think time must be >= 0, got {mean_s}")
    return [rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0 for _ in range(num)]
