"""The routes and request fields vLLM users reach for, on the shared live server (real engine on
the tiny model, ngram drafter): /v1/models/{id}, /tokenize, /detokenize, /version, best_of,
vLLM's request extras, the fields refused with a 400 naming them, and chat logprobs under
speculation."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from hipfire_serve.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _error(response: httpx.Response, status: int, param: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error


def test_models_retrieve_and_unknown_id(client):
    listed = client.models.list().data[0]
    model = client.models.retrieve(listed.id)
    assert (model.id, model.object, model.created, model.owned_by) == (
        listed.id,
        "model",
        listed.created,
        listed.owned_by,
    )
    assert model.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("org/other-model")
    error = exc.value.body
    assert error["code"] == "model_not_found" and "org/other-model" in error["message"]


def test_tokenize_prompt(server, tokenizer):
    text = "def add(a, b):"
    reply = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert reply == {
        "count": len(ids),
        "max_model_len": 256,
        "tokens": ids,
        "token_strs": [tokenizer.id_to_piece(i) for i in ids],
    }
    plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert plain["token_strs"] is None
    # a prompt past the context is counted, not refused
    long = _post(server, "/tokenize", {"prompt": "fox " * 400}).json()
    assert long["count"] > long["max_model_len"]


def test_tokenize_messages_renders_the_chat_template(server, tokenizer):
    messages = [*USER, {"role": "assistant", "content": "Hi th"}]
    reply = _post(server, "/tokenize", {"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert reply["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    closed = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert tokenizer.decode(closed.json()["tokens"], skip_special_tokens=False).endswith(
        "Hi th<|im_end|>\n"
    )
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    open_turn = _post(server, "/tokenize", body).json()["tokens"]
    assert tokenizer.decode(open_turn, skip_special_tokens=False).endswith("assistant\nHi th")
    both = {"messages": messages, "continue_final_message": True}
    _error(_post(server, "/tokenize", both), 400, "continue_final_message")
    _error(_post(server, "/tokenize", {"prompt": "x", "messages": USER}), 400, "prompt")
    _error(_post(server, "/tokenize", {"prompt": "x", "model": "nope"}), 404, "model")
    kwargs = {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}
    _error(_post(server, "/tokenize", kwargs), 400, "chat_template_kwargs")


def test_detokenize_round_trip_and_bad_ids(server, tokenizer):
    text = "<|im_start|>Grüße, 東京 🚀"
    ids = tokenizer.encode(text)
    reply = _post(server, "/detokenize", {"tokens": ids})
    assert reply.json() == {"prompt": text}  # special tokens included, as vLLM decodes
    error = _error(_post(server, "/detokenize", {"tokens": [1, 10**6]}), 400, "tokens")
    assert "tokens[1]" in error["message"]
    _error(_post(server, "/detokenize", {}), 400, "tokens")


def test_version(server):
    reply = httpx.get(server.url + "/version", timeout=30)
    assert reply.status_code == 200 and set(reply.json()) == {"version"}
    assert reply.json()["version"]


def test_best_of_equal_to_n_is_served_other_values_are_refused(client, model_id):
    r = client.completions.create(
        model=model_id, prompt="The quick", max_tokens=3, n=2, best_of=2, seed=1
    )
    assert len(r.choices) == 2
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_id, prompt="The quick", max_tokens=3, best_of=3)
    assert exc.value.body["param"] == "best_of" and "not supported" in exc.value.body["message"]


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize(
    ("chat", "field", "value"),
    [
        (False, "use_beam_search", True),
        (False, "prompt_logprobs", 1),
        (False, "priority", 3),
        (False, "allowed_token_ids", [5, 6]),
        (False, "spaces_between_special_tokens", False),
        (True, "store", True),
        (True, "modalities", ["text", "audio"]),
        (True, "functions", [{"name": "f", "parameters": {}}]),
        (True, "chat_template", "{{ messages }}"),
        (True, "reasoning_effort", "high"),  # the tiny model's template does not read it
    ],
)
def test_fields_not_served_as_asked_get_400_naming_them(server, chat, field, value):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": USER} if chat else {"prompt": "x"}
    _error(_post(server, path, {**body, "max_tokens": 1, field: value}), 400, field)


def test_neutral_values_of_those_fields_are_served(server):
    neutral = {
        "use_beam_search": False,
        "priority": 0,
        "length_penalty": 1.0,
        "spaces_between_special_tokens": True,
        "store": False,
        "modalities": ["text"],
        "metadata": {"team": "a"},
        "prediction": None,
    }
    body = {"messages": USER, "max_tokens": 1, **neutral}
    assert _post(server, "/v1/chat/completions", body).status_code == 200


def test_vllm_extras_that_change_the_reply(server, tokenizer, client, model_id):
    prompt = "The quick brown fox jumps over the lazy dog."
    greedy = dict(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    r = client.completions.create(**greedy, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    r = client.completions.create(**greedy, extra_body={"add_special_tokens": False})
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    r = client.completions.create(**greedy, extra_body={"request_id": "trace-7"})
    assert r.id == "cmpl-trace-7"
    r = client.completions.create(
        **greedy, logprobs=2, extra_body={"return_tokens_as_token_ids": True}
    )
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    full = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[2:4]
    kept = client.completions.create(
        **greedy, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


def test_chat_echo_continues_the_final_message(client, model_id):
    messages = [*USER, {"role": "assistant", "content": "Hi th"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    kwargs = dict(model=model_id, messages=messages, max_tokens=4, temperature=0)
    r = client.chat.completions.create(**kwargs, extra_body=extra)
    assert r.choices[0].message.content.startswith("Hi th")
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.3, 11)])
def test_chat_logprobs_agree_with_and_without_speculation(client, model_id, temperature, seed):
    """The ngram drafter finds the repeated text in the prompt, so `on` verifies drafts; each
    emitted token's logprob and top alternatives must be those plain decoding reports (greedy,
    and sampled with a seed, whose text does not depend on the route)."""
    loop = "for i in range(10):\n    print(i * i)\n"
    messages = [{"role": "user", "content": loop * 3}]
    replies = {}
    for mode in ("off", "on"):
        replies[mode] = client.chat.completions.create(
            model=model_id,
            messages=messages,
            max_tokens=24,
            temperature=temperature,
            seed=seed,
            logprobs=True,
            top_logprobs=3,
            extra_body={"speculation": mode, "ignore_eos": True},
        )
    assert replies["on"].usage.model_extra["num_accepted_tokens"] > 0
    assert replies["off"].usage.model_extra["num_draft_tokens"] == 0
    plain, spec = (replies[m].choices[0].logprobs.content for m in ("off", "on"))
    assert replies["on"].choices[0].message.content == replies["off"].choices[0].message.content
    assert [t.token for t in spec] == [t.token for t in plain] and len(plain) == 24
    for a, b in zip(plain, spec):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
