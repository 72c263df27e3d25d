"""Prompt cohorts and the seeded request source.

A cohort is a JSONL file, one prompt per line: `{"id": "...", "prompt": "..."}` or, for chat
servers, `{"id": "...", "messages": [{"role": "user", "content": "..."}]}` (`prompt` is then
optional). Three cohorts ship with the package (`code`, `prose`, `mixed`); `--prompts FILE`
brings your own in the same format.

Reproducibility: the order in which prompts are used is a seeded shuffle, reshuffled with the
same seed stream on every pass when a run needs more requests than the cohort has.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

COHORTS = ("code", "prose", "mixed")


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt: str  # for chat entries: the last user message (for logs and the completions API)
    messages: tuple[dict, ...] | None = None


def parse_jsonl(text: str, origin: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{origin}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{origin}:{lineno}: expected an object")
        messages = entry.get("messages")
        prompt = entry.get("prompt")
        if messages is not None:
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise ValueError(f"{origin}:{lineno}: messages must be a list of role/content")
            if prompt is None:
                users = [m["content"] for m in messages if m["role"] == "user"]
                prompt = users[-1] if users else ""
            messages = tuple(messages)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{origin}:{lineno}: needs a non-empty 'prompt' or 'messages'")
        prompts.append(Prompt(str(entry.get("id", f"{origin}:{lineno}")), prompt, messages))
    if not prompts:
        raise ValueError(f"{origin}: no prompts")
    return prompts


def load_cohort(name: str) -> list[Prompt]:
    if name not in COHORTS:
        raise ValueError(f"unknown cohort {name!r}; shipped: {', '.join(COHORTS)}")
    entry = resources.files("loadtests").joinpath("cohorts").joinpath(f"{name}.jsonl")
    text = entry.read_text("utf-8")
    return parse_jsonl(text, name)


def load_prompts_file(path: str | Path) -> list[Prompt]:
    return parse_jsonl(Path(path).read_text(encoding="utf-8"), str(path))


def seeded_order(prompts: list[Prompt], num_requests: int, seed: int) -> list[Prompt]:
    """`num_requests` prompts: successive seeded shuffles of the whole list."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    while len(out) < num_requests:
        batch = list(prompts)
        rng.shuffle(batch)
        out.extend(batch)
    return out[:num_requests]
