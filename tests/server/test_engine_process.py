"""`--engine-loop process`: the same API with the engine in a child process."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest

from tests.server.conftest import start_real_server


@pytest.fixture(scope="module")
def process_server(tiny_model_dir):
    running = start_real_server(tiny_model_dir, engine_loop="process")
    yield running
    running.stop()


def test_completions_chat_and_streams(process_server):
    client = openai.OpenAI(base_url=process_server.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(
        model="tiny-llama",
        prompt=["def add", "class Slot"],
        n=2,
        max_tokens=6,
        temperature=0,
        logprobs=1,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == 6 or c.finish_reason == "stop" for c in r.choices)
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens >= 1


def test_engine_errors_cross_the_process_boundary(process_server):
    url = process_server.url + "/v1/completions"
    too_long = httpx.post(url, json={"prompt": [5] * 200, "max_tokens": 100}, timeout=30)
    assert too_long.status_code == 400 and "256" in too_long.json()["error"]["message"]
    bad_token = httpx.post(url, json={"prompt": [10**6], "max_tokens": 2}, timeout=30)
    assert bad_token.status_code == 400 and bad_token.json()["error"]["param"] == "prompt"


def test_disconnects_leave_the_child_engine_idle(process_server):
    body = {"prompt": "for i in", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def drop(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_raw():
                break

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=process_server.url, timeout=30) as client:
            await asyncio.gather(*(drop(client) for _ in range(12)))

    asyncio.run(storm())
    stats = process_server.wait_idle()
    assert stats.live_slots == 0 and stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_child_ignores_terminal_signals(process_server):
    """Ctrl+C reaches the whole process group: the child must leave shutdown to the server."""
    child_pid = process_server.engine.pid
    os.kill(child_pid, signal.SIGINT)
    os.kill(child_pid, signal.SIGTERM)
    ok = httpx.post(
        process_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200 and process_server.engine.running
