"""The multi-turn load shape: C conversations live at once, each turn waiting for the last.

C conversation slots (closed loop, like refill): a slot runs one conversation turn after turn,
sending the next turn when the previous reply has ended (after an optional think time, as a
user would), then takes the next conversation, until all are done. Turns go to the chat route
with the whole history (conversation.py). A failed turn ends its conversation: what it would
have sent next depends on the reply it did not get.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

import httpx

from loadtests.client import ClientConfig, PlannedRequest, stream_request
from loadtests.conversation import Conversation, ConversationScript, think_times
from loadtests.records import RequestRecord
from loadtests.runners import Tenant


def turn_request(conv: Conversation, tenant: Tenant, num_turns: int, seed: int) -> PlannedRequest:
    """The next turn of `conv` as a request; tags: `conversation` and `turn` (from 1)."""
    c, t = conv.script.conv_id, conv.num_done
    req_id = c * num_turns + t
    return PlannedRequest(
        req_id=req_id,
        prompt_id=f"c{c}-t{t + 1}",
        prompt=conv.next_user,
        messages=conv.next_messages(),
        tenant=tenant.name,
        api_key=tenant.api_key,
        seed=seed + req_id,
        tags={"conversation": c, "turn": t + 1},
    )


async def run_multi_turn(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    scripts: Sequence[ConversationScript],
    concurrency: int,
    clock: Callable[[], float],
    on_done: Callable[[RequestRecord], None],
    *,
    tenants: Sequence[Tenant],
    seed: int = 0,
    think_time_s: float = 0.0,
) -> tuple[list[RequestRecord], list[Conversation]]:
    """Every turn's record (by req_id) and the conversations as they ended."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if cfg.endpoint != "chat":
        raise ValueError("multi-turn conversations use the chat route")
    pending = iter(scripts)
    records: list[RequestRecord] = []
    conversations: list[Conversation] = []

    async def slot() -> None:
        for script in pending:
            conv = Conversation(script)
            conversations.append(conv)
            num_turns = len(script.user_turns)
            tenant = tenants[script.conv_id % len(tenants)]
            rng = random.Random(seed * 1_000_003 + script.conv_id)
            pauses = think_times(think_time_s, num_turns - 1, rng)
            while not conv.done:
                if conv.num_done and pauses[conv.num_done - 1] > 0:
                    await asyncio.sleep(pauses[conv.num_done - 1])
                record = await stream_request(
                    http, cfg, turn_request(conv, tenant, num_turns, seed), clock
                )
                records.append(record)
                on_done(record)
                if not record.ok:
                    break
                conv.add_reply(record.output_text)

    await asyncio.gather(*(slot() for _ in range(concurrency)))
    conversations.sort(key=lambda c: c.script.conv_id)
    return sorted(records, key=lambda r: r.req_id), conversations
