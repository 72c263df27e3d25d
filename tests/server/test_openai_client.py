"""The official `openai` client against a live server on the real engine (tiny model, CPU)."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, model):
    assert model == "tiny-llama"


def test_completion_greedy_shape_and_usage(client, model):
    r = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0
    assert r.model == model and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extras = r.usage.model_extra
    assert extras["num_accepted_tokens"] <= extras["num_draft_tokens"]
    again = client.completions.create(
        model=model, prompt="def add(a, b):", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_streamed_completion_equals_non_streamed(client, model):
    kwargs = dict(model=model, prompt="The quick brown", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_chat_non_streamed_and_streamed(client, model):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_choices_and_prompt_lists(client, model):
    r = client.completions.create(
        model=model, prompt=["for i in", "class Slot"], n=3, max_tokens=5, temperature=0.8, seed=11
    )
    assert sorted(c.index for c in r.choices) == list(range(6))
    chat = client.chat.completions.create(
        model=model,
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=5,
        messages=[{"role": "user", "content": "x"}],
    )
    assert [c.index for c in chat.choices] == [0, 1]
    ids = client.completions.create(
        model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0
    )
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_seeds_reproduce_sampled_output(client, model):
    """Same seed, same text, for a fixed speculation mode. (Under "auto" the policy may verify a
    request speculatively in one run and plainly in another, which draws different random
    numbers: the distribution is the target's either way, the sample need not repeat.)"""
    for speculation in ("off", "on"):
        kwargs = dict(
            model=model,
            prompt="Speculative decoding",
            max_tokens=12,
            temperature=1.0,
            top_p=0.95,
            extra_body={"top_k": 50, "min_p": 0.01, "speculation": speculation},
        )
        a = client.completions.create(**kwargs, seed=1234)
        b = client.completions.create(**kwargs, seed=1234)
        assert a.choices[0].text == b.choices[0].text
        texts = {client.completions.create(**kwargs, seed=s).choices[0].text for s in range(5)}
        assert len(texts) > 1  # the seed matters


def test_stop_strings_end_the_text(client, model):
    base = client.completions.create(
        model=model,
        prompt="for i in range",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    cut = client.completions.create(
        model=model,
        prompt="for i in range",
        max_tokens=16,
        temperature=0,
        stop=[stop, "\u2603"],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model=model,
        prompt="for i in range",
        max_tokens=16,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_logprobs_completion_and_chat(client, model):
    r = client.completions.create(
        model=model, prompt="def add", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) <= 2 and t.logprob <= 0.0 for t in content)


def test_echo_prepends_the_prompt(client, model):
    r = client.completions.create(
        model=model, prompt="class Slot:", max_tokens=3, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("class Slot:")


def test_speculation_field_and_draft_counts(client, model):
    for mode in ("on", "off", "auto"):
        r = client.completions.create(
            model=model,
            prompt="for i in range(10):\n    print(i",
            max_tokens=12,
            temperature=0,
            extra_body={"speculation": mode, "ignore_eos": True},
        )
        extras = r.usage.model_extra
        assert r.usage.completion_tokens == 12
        if mode == "off":
            assert extras["num_draft_tokens"] == 0
        assert 0 <= extras["num_accepted_tokens"] <= extras["num_draft_tokens"]
