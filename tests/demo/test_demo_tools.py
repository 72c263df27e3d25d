"""The demo training tools: the training model equals transformers' Llama, the acceptance
measurement's drafters and round walk, the tokenizer and chat format, the corpus split."""

from __future__ import annotations

import json

import jinja2
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hipfire_serve.demo import corpus, sources
from hipfire_serve.demo.evaluate import (
    accepted_prefix_len,
    ngram_propose,
    simulate_rounds,
    summarize_rounds,
)
from hipfire_serve.demo.model import DemoCausalLM, DemoModelConfig
from hipfire_serve.demo.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    special_token_ids,
    train_tokenizer,
)
from hipfire_serve.demo.train import lr_at

tokens = st.lists(st.integers(0, 5), min_size=0, max_size=40)


def test_training_model_is_transformers_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = DemoModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = DemoCausalLM(cfg).eval()
    (tmp_path / "config.json").write_text(json.dumps(cfg.hf_config([2, 0], 0)))
    save_file(model.hf_state_dict(torch.float32), str(tmp_path / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert DemoModelConfig.from_hf_config(cfg.hf_config([2], 0)) == cfg


@given(tokens, st.integers(1, 7))
def test_ngram_proposal_continues_an_earlier_match_of_a_suffix(context, num_draft):
    proposal = ngram_propose(context, num_draft)
    assert len(proposal) <= num_draft
    if not proposal:
        # no earlier occurrence of even the last token
        assert not context or context[-1] not in context[:-1]
        return
    # some suffix of length n (1..3) occurs earlier and the proposal is what followed it
    ok = False
    for n in range(1, 4):
        suffix = context[len(context) - n :]
        for start in range(len(context) - n):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + num_draft]
                ok |= follow == proposal
    assert ok


def test_ngram_prefers_the_longest_and_latest_match():
    context = [1, 2, 3, 9, 7, 3, 8, 2, 3]
    # suffix [2, 3] occurs at 1 (followed by 9, 7); [3] alone would pick the later 3 -> 8
    assert ngram_propose(context, 2) == [9, 7]
    assert ngram_propose([5, 1, 5, 2, 5], 1) == [2]  # latest earlier occurrence of [5]
    assert ngram_propose([1, 2, 3], 4) == []


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_accepted_prefix_len_is_the_common_prefix(proposal, reference):
    num = accepted_prefix_len(proposal, reference)
    assert proposal[:num] == reference[:num]
    assert num == min(len(proposal), len(reference)) or proposal[num] != reference[num]


@given(st.lists(st.integers(0, 3), min_size=30, max_size=30), st.integers(1, 7), st.data())
def test_round_walk_covers_the_generation_exactly_once(reference, num_draft, data):
    num_gen = len(reference) - num_draft
    proposals = data.draw(
        st.lists(
            st.lists(st.integers(0, 3), max_size=num_draft), min_size=num_gen, max_size=num_gen
        )
    )
    rounds = simulate_rounds(reference, num_gen, num_draft, lambda i: proposals[i])
    emitted = sum(a + 1 for _, a in rounds)
    assert num_gen <= emitted < num_gen + num_draft + 1
    assert all(0 <= a <= p <= num_draft for p, a in rounds)
    stats = summarize_rounds(rounds, num_draft)
    assert stats.num_emitted == emitted
    assert 1.0 <= stats.mean_accepted_len <= num_draft + 1
    assert all(0.0 <= a <= 1.0 for a in stats.position_acceptance)


def test_round_walk_with_an_oracle_and_with_no_drafter():
    reference = list(range(40))
    oracle = simulate_rounds(reference, 32, 7, lambda i: reference[i : i + 7])
    assert oracle == [(7, 7)] * 4  # 8 tokens a round
    silent = simulate_rounds(reference, 32, 7, lambda i: [])
    assert summarize_rounds(silent, 7).mean_accepted_len == 1.0
    assert len(silent) == 32


def test_tokenizer_has_special_ids_and_round_trips_bytes():
    texts = ["def f(x):\n    return x + 1\n", "To be, or not to be: that is the question.\n"] * 20
    tok = train_tokenizer(texts, vocab_size=300)
    assert list(special_token_ids(tok).values()) == [0, 1, 2]
    for text in ("naïve café ✓\t\n", "<|im_start|>user\nhi<|im_end|>\n"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    chat_ids = tok.encode(corpus.chat_text("a", "b"), add_special_tokens=False).ids
    assert chat_ids.count(1) == 2 and chat_ids.count(2) == 2  # <|im_start|>, <|im_end|>
    assert set(SPECIAL_TOKENS) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


def test_chat_template_renders_like_the_training_samples():
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]
    assert template.render(messages=messages) == corpus.chat_text("u1", "a1")
    opened = template.render(messages=messages[:1], add_generation_prompt=True)
    assert opened.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_stdlib_reader_skips_site_packages_and_other_encodings(tmp_path):
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_text("import x\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    pass\n")
    (tmp_path / "latin.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    docs = sources.stdlib_code_docs(tmp_path)
    assert [d.name for d in docs] == ["pkg/mod.py"]
    assert docs[0].kind == "code" and docs[0].is_val == sources._held_out("pkg/mod.py")


def test_validation_split_is_stable_and_about_one_in_twenty():
    names = [f"module_{i}.py" for i in range(4000)]
    held = [n for n in names if sources._held_out(n)]
    assert held == [n for n in names if sources._held_out(n)]
    assert 0.03 < len(held) / len(names) < 0.07


def test_chat_samples_split_a_document_into_prompt_and_continuation():
    lines = [f"x_{i} = {i}\n" for i in range(60)]
    picked = next(
        name
        for name in (f"m{i}.py" for i in range(200))
        if corpus._picked(name, corpus.CHAT_ONE_IN)
    )
    doc = sources.Document("code", "cpython-stdlib", picked, "".join(lines), False)
    (sample,) = corpus.chat_samples(doc)
    user, assistant = sample.split("<|im_start|>assistant\n")
    assert "".join(lines[:20]) in user and assistant == "".join(lines[20:50]) + "<|im_end|>\n"


def test_lr_schedule_warms_up_holds_and_decays():
    peak = 1e-3
    assert lr_at(0, 0.0, peak) < lr_at(50, 0.1, peak) < lr_at(200, 0.2, peak) == peak
    assert lr_at(1000, 0.5, peak) == peak
    decayed = [lr_at(1000, p, peak) for p in (0.75, 0.85, 0.95, 1.0)]
    assert decayed == sorted(decayed, reverse=True) and decayed[-1] > 0
