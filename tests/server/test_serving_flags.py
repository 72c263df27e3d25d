"""vLLM's serving flags on live servers: `--chat-template`, `--generation-config`, a model whose
tokenizer is only a SentencePiece `tokenizer.model`, and, on a real `hipfire-serve serve`
process, the positional MODEL with `--api-key`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hipfire_serve.server.config import resolve
from hipfire_serve.server.model_overrides import generation_defaults, load_chat_template
from hipfire_serve.tokenizer import Tokenizer
from tests.server.conftest import RunningServer, start_real_server
from tests.server.sentencepiece_models import SPACE, piece_id, spm_model_dir

ROOT = Path(__file__).resolve().parents[2]

TEMPLATE = (
    "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
# the model's own generation defaults: greedy through top_k, at most 5 new tokens
GENERATION = {"eos_token_id": [2], "temperature": 0.8, "top_k": 1, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("spm-model") / "tiny-spm"
    model_dir = spm_model_dir(make_tiny_model(root, "llama"))
    (model_dir / "generation_config.json").write_text(json.dumps(GENERATION))
    return model_dir


@pytest.fixture(scope="module")
def flags_server(spm_dir, tmp_path_factory) -> Iterator[RunningServer]:
    template_file = tmp_path_factory.mktemp("template") / "chat.jinja"
    template_file.write_text(TEMPLATE)
    running = start_real_server(spm_dir, chat_template=str(template_file))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(flags_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=flags_server.url + "/v1", api_key="unused", max_retries=0)


def _tokenize(server: RunningServer, body: dict) -> dict:
    response = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_sentencepiece_model_serves_text(flags_server, client):
    reply = _tokenize(flags_server, {"prompt": "hello world", "return_token_strs": True})
    assert reply["tokens"] == [1, piece_id(SPACE + "hello"), piece_id(SPACE + "world")]
    assert reply["token_strs"] == ["<s>", SPACE + "hello", SPACE + "world"]
    text = "Hi, Köln!\nthe 東京 🚀"
    ids = _tokenize(flags_server, {"prompt": text, "add_special_tokens": False})["tokens"]
    decoded = httpx.post(flags_server.url + "/detokenize", json={"tokens": ids}, timeout=60)
    assert decoded.json() == {"prompt": text}
    kwargs = dict(model="tiny-spm", prompt="the quick", max_tokens=4, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text


def test_chat_template_flag_replaces_the_models(flags_server, spm_dir, client):
    messages = [{"role": "user", "content": "hello"}]
    reply = _tokenize(flags_server, {"messages": messages})
    tokenizer = Tokenizer.from_dir(spm_dir)
    rendered = "<s>[user] hello\n[assistant]"
    assert reply["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    chat = client.chat.completions.create(
        model="tiny-spm", messages=messages, max_tokens=2, temperature=0
    )
    assert chat.usage.prompt_tokens == reply["count"]


def test_generation_config_gives_defaults_a_request_overrides(client):
    kwargs = dict(model="tiny-spm", prompt="the quick brown", extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kwargs, max_tokens=20, temperature=0)
    assert greedy.usage.completion_tokens == 5  # max_new_tokens caps max_tokens
    for seed in range(3):  # temperature 0.8 from the file, but top_k 1 from it too
        sampled = client.completions.create(**kwargs, max_tokens=5, seed=seed)
        assert sampled.choices[0].text == greedy.choices[0].text
    texts = {
        client.completions.create(
            **{**kwargs, "extra_body": {"ignore_eos": True, "top_k": 0}},
            max_tokens=5,
            temperature=1.5,
            seed=seed,
        )
        .choices[0]
        .text
        for seed in range(4)
    }
    assert texts - {greedy.choices[0].text}


def test_generation_defaults_read_as_vllm_does(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 50, "do_sample": True})
    )
    # top_k 50 is the library's default: vLLM takes only what differs from it
    assert generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults(str(tmp_path), None) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults("vllm", tmp_path) == {}
    assert generation_defaults("auto", tmp_path / "missing") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults("auto", tmp_path)
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        generation_defaults(str(tmp_path / "missing"), None)


def test_chat_template_values(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(file)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'a' }}\\n{{ 'é' }}") == "{{ 'a' }}\n{{ 'é' }}"
    assert load_chat_template("") is None
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="compile"):
        load_chat_template("{% for %}")


def test_positional_model_and_repeated_keys_resolve():
    engine, server = resolve(["/m", "--api-key", "a", "b", "--api-key", "c"], environ={})
    assert engine.model == "/m" and server.api_key == ("a", "b", "c")
    _, server = resolve([], environ={"HIPFIRE_API_KEY": "a, b"})
    assert server.api_key == ("a", "b")
    with pytest.raises(ValueError, match="given twice"):
        resolve(["/m", "--model", "/n"], environ={})
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        resolve(["--generation-config", "/nowhere"], environ={})


def _serve(*argv: str) -> tuple[subprocess.Popen, str]:
    """A real `hipfire-serve serve ARGV...` process on the tiny model's settings; its URL."""
    cmd = [sys.executable, "-m", "hipfire_serve.cli", "serve", *argv]
    cmd += ["--draft", "ngram", "--device", "cpu", "--dtype", "float32", "--graphs", "off"]
    cmd += ["--kv-cache-memory", "8MiB", "--max-model-len", "256", "--port", "0"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1 with (.*)", line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"http://127.0.0.1:{match.group(1)}", match.group(2)
    proc.wait(timeout=60)
    pytest.fail("server did not start:\n" + "".join(lines))


def test_serve_process_takes_the_model_positionally_with_keys(spm_dir):
    inline = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    flags = ["--served-model-name", "served", "--chat-template", inline]
    flags += ["--generation-config", "vllm", "--log-level", "warning"]
    proc, url, access = _serve(str(spm_dir), *flags, "--api-key", "sk-a", "sk-b")
    try:
        assert access.startswith("2 API key(s)")
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-b", max_retries=0)
        assert client.models.retrieve("served").id == "served"
        r = client.completions.create(
            model="served", prompt="the", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 8  # 'vllm': the model's max_new_tokens is not read
        body = {"messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": "Bearer sk-a"}
        tokens = httpx.post(url + "/tokenize", json=body, headers=headers, timeout=30).json()
        rendered = Tokenizer.from_dir(spm_dir).encode("<user>hi", add_special_tokens=False)
        assert tokens["tokens"] == rendered
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_serve_refuses_a_second_model_and_a_bad_template(spm_dir):
    cmd = [sys.executable, "-m", "hipfire_serve.cli", "serve", str(spm_dir)]
    for extra, reason in (
        (["--model", "/other"], "given twice"),
        (["--chat-template", "{%"], "compile"),
    ):
        done = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2 and reason in done.stderr, done.stderr
