"""The shared-prefix workload: groups of requests that open with the same long system prompt.

G groups, each with a system prompt of S words (about S tokens, see words.py). Every request is
its group's system prompt followed by a question of Q words of its own. Requests are spread
evenly over the groups and sent in a seeded order, so each group's prompt recurs throughout the
run: a server with prefix caching computes a system prompt once, and later requests of the
group compute only their question. Texts differ from their first word on (across groups, and
across the questions of a run), so no two requests share more than their group's prompt.

On the completions route a prompt is the system prompt, a blank line, then the question; on the
chat route the two are a system and a user message.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.client import PlannedRequest
from loadtests.runners import Tenant
from loadtests.words import distinct_texts


@dataclass(frozen=True)
class SharedPrefixConfig:
    num_groups: int = 8  # distinct system prompts
    system_prompt_len: int = 2048  # words (about tokens) of each group's system prompt
    question_len: int = 32  # words of each request's own part
    num_requests: int = 64

    def check(self) -> None:
        for name in ("num_groups", "system_prompt_len", "question_len", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def plan_shared_prefix(
    cfg: SharedPrefixConfig, tenants: Sequence[Tenant], seed: int
) -> list[PlannedRequest]:
    """The run's requests; tags: `group` and `group_rank` (0 for the group's first request)."""
    cfg.check()
    rng = random.Random(seed)
    systems = distinct_texts(rng, cfg.num_groups, cfg.system_prompt_len)
    questions = distinct_texts(rng, cfg.num_requests, cfg.question_len)
    groups = [i % cfg.num_groups for i in range(cfg.num_requests)]
    rng.shuffle(groups)
    seen = [0] * cfg.num_groups
    requests = []
    for i, (group, question) in enumerate(zip(groups, questions)):
        tenant = tenants[i % len(tenants)]
        system = systems[group]
        requests.append(
            PlannedRequest(
                req_id=i,
                prompt_id=f"g{group}-q{i}",
                prompt=f"{system}\n\n{question}",
                messages=(
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ),
                tenant=tenant.name,
                api_key=tenant.api_key,
                seed=seed + i,
                tags={"group": group, "group_rank": seen[group]},
            )
        )
        seen[group] += 1
    return requests
