"""Chat templates render exactly as `transformers`' `apply_chat_template` renders them."""

from __future__ import annotations

import datetime
import json
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hipfire_serve.tokenizer import Tokenizer

CHATML = """\
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- set loop_messages = messages[1:] %}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
{{- '<|im_start|>tools\\n' }}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] }}{% endgeneration %}\
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA2 = """\
{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}\
{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}\
{% set system_message = false %}{% endif %}
{% for message in loop_messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
{% endif %}
{% if loop.index0 == 0 and system_message != false %}\
{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}\
{% else %}{% set content = message['content'] %}{% endif %}
{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}\
{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}
{% endfor %}
"""

LLAMA3 = """\
{%- set ns = namespace(turns=0) %}
{{- bos_token }}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYear: ' + strftime_now('%Y') + '\\n' }}
{%- if tools is not none %}{{- tools | tojson(indent=2) + '\\n' }}{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- set ns.turns = ns.turns + 1 %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim }}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "llama3": LLAMA3}

CONTENT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(CONTENT)})
    num_turns = draw(st.integers(1, 4))
    for i in range(num_turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": draw(CONTENT)})
    return messages


@pytest.fixture(scope="module")
def template_dirs(byte_fallback_dir, tmp_path_factory):
    """One model directory per template, with <s>/</s> special tokens."""
    dirs = {}
    for name, source in TEMPLATES.items():
        root = tmp_path_factory.mktemp(f"tpl_{name}")
        shutil.copy(byte_fallback_dir / "tokenizer.json", root / "tokenizer.json")
        cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": source}
        (root / "tokenizer_config.json").write_text(json.dumps(cfg))
        dirs[name] = root
    return dirs


@pytest.fixture(scope="module")
def pairs(template_dirs):
    transformers = pytest.importorskip("transformers")
    return {
        name: (
            Tokenizer.from_dir(root),
            transformers.PreTrainedTokenizerFast.from_pretrained(str(root)),
        )
        for name, root in template_dirs.items()
    }


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "ü"}}}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@given(messages=conversations(), add_generation_prompt=st.booleans(), use_tools=st.booleans())
def test_matches_transformers(pairs, name, messages, add_generation_prompt, use_tools):
    ours, theirs = pairs[name]
    tools = TOOLS if use_tools else None
    expected = theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = ours.apply_chat_template(messages, add_generation_prompt, tools=tools)
    assert got == expected


def test_generation_prompt_and_helpers(pairs):
    ours, _ = pairs["llama3"]
    text = ours.apply_chat_template([{"role": "user", "content": " hi "}])
    assert text.startswith("<s><|start_header_id|>system")
    assert f"Year: {datetime.datetime.now().year}" in text
    assert text.endswith("hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}], False)
    assert no_prompt.endswith("hi<|eot_id|>")


def test_raise_exception_becomes_value_error(pairs):
    ours, _ = pairs["llama2"]
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_and_broken_templates(byte_level_dir, tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(byte_level_dir).apply_chat_template([{"role": "user", "content": "x"}])
    shutil.copy(byte_level_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escape(byte_level_dir, tmp_path):
    shutil.copy(byte_level_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template error"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates(byte_level_dir, tmp_path):
    shutil.copy(byte_level_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ messages | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    tok = Tokenizer.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, template_name="tool_use") == "T1"
    with pytest.raises(ValueError, match="no chat template named 'other'"):
        tok.apply_chat_template(msgs, template_name="other")
