"""The prefix-caching workloads' prompt builders, conversation state, per-part summaries and the
prefix-cache counters read from /metrics."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.breakdown import by_turn, ttft_split
from loadtests.conversation import (
    Conversation,
    ConversationScript,
    MultiTurnConfig,
    build_scripts,
    think_times,
)
from loadtests.promtext import Snapshot
from loadtests.records import RequestRecord
from loadtests.runners import parse_tenants
from loadtests.server_metrics import summarize_delta
from loadtests.shared_prefix import SharedPrefixConfig, plan_shared_prefix
from loadtests.table import prefix_hit
from loadtests.words import WORDS, distinct_texts, words

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "hipfire_serve/demo/models/target"


def test_words_are_one_token_each_in_the_demo_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.fspath(DEMO_TOKENIZER / "tokenizer.json"))
    assert len(set(WORDS)) == len(WORDS) >= 400
    assert all(w.isalpha() and w.islower() for w in WORDS)
    assert all(len(tok.encode(" " + w).ids) == 1 for w in WORDS)
    text = words(random.Random(3), 2048)
    assert len(text.split()) == 2048
    assert 2048 <= len(tok.encode(text).ids) <= 2050  # the first word has no leading space


@given(st.integers(0, 600), st.integers(1, 6), st.integers(0, 2**32))
def test_distinct_texts(count, num_words, seed):
    if count > 1 and len(WORDS) ** num_words < count:
        with pytest.raises(ValueError):
            distinct_texts(random.Random(seed), count, num_words)
        return
    texts = distinct_texts(random.Random(seed), count, num_words)
    assert len(texts) == count == len(set(texts))
    assert all(len(t.split()) == num_words for t in texts)
    if count <= len(WORDS):
        assert len({t.split()[0] for t in texts}) == count  # they part at the first word


@settings(max_examples=40, deadline=None)
@given(
    num_groups=st.integers(1, 12),
    system_len=st.integers(1, 300),
    question_len=st.integers(1, 40),
    num_requests=st.integers(1, 80),
    seed=st.integers(0, 2**31),
    chat=st.booleans(),
)
def test_shared_prefix_plan(num_groups, system_len, question_len, num_requests, seed, chat):
    cfg = SharedPrefixConfig(num_groups, system_len, question_len, num_requests)
    tenants = parse_tenants(["a=ka", "b=kb"])
    plan = plan_shared_prefix(cfg, tenants, seed)
    assert plan == plan_shared_prefix(cfg, tenants, seed)  # seeded
    assert [r.req_id for r in plan] == list(range(num_requests))
    systems: dict[int, str] = {}
    questions = []
    for r in plan:
        system, user = (m["content"] for m in r.messages)
        assert [m["role"] for m in r.messages] == ["system", "user"]
        assert r.prompt == f"{system}\n\n{user}"  # the completions route sends the same text
        assert len(system.split()) == system_len and len(user.split()) == question_len
        group = r.tags["group"]
        assert systems.setdefault(group, system) == system  # one prompt per group, shared
        questions.append(user)
    # groups used evenly; ranks count each group's requests in order of sending
    counts = [sum(r.tags["group"] == g for r in plan) for g in range(num_groups)]
    assert max(counts) - min(counts) <= 1
    for g in systems:
        ranks = [r.tags["group_rank"] for r in plan if r.tags["group"] == g]
        assert ranks == list(range(len(ranks)))
    # distinct groups part at their first word; every request's own part is its own
    assert len({s.split()[0] for s in systems.values()}) == len(systems)
    assert len(set(questions)) == num_requests
    assert {r.tenant for r in plan} == ({"a", "b"} if num_requests > 1 else {"a"})


def test_shared_prefix_rejects_empty_parts():
    with pytest.raises(ValueError, match="--question-len"):
        plan_shared_prefix(SharedPrefixConfig(question_len=0), parse_tenants([]), 0)


def test_scripts_are_seeded_and_distinct():
    cfg = MultiTurnConfig(num_conversations=5, num_turns=3, system_prompt_len=20, user_len=6)
    scripts = build_scripts(cfg, seed=1)
    assert scripts == build_scripts(cfg, seed=1) != build_scripts(cfg, seed=2)
    users = [u for s in scripts for u in s.user_turns]
    assert len(users) == 15 == len(set(users))
    assert len({s.system_prompt for s in scripts}) == 5
    assert all(len(u.split()) == 6 for u in users)
    shared = build_scripts(MultiTurnConfig(4, 2, 10, 3, num_system_prompts=2), seed=0)
    assert [s.system_prompt for s in shared][:2] == [s.system_prompt for s in shared][2:]
    none = build_scripts(MultiTurnConfig(2, 2, 0, 3), seed=0)
    assert Conversation(none[0]).next_messages()[0]["role"] == "user"


@given(
    st.lists(st.text(max_size=12), min_size=1, max_size=6),
    st.booleans(),
)
def test_conversation_sends_history_with_the_replies_given(replies, with_system):
    users = tuple(f"user message {i}" for i in range(len(replies)))
    script = ConversationScript(7, "be brief" if with_system else "", users)
    conv = Conversation(script)
    expected: list[dict] = [{"role": "system", "content": "be brief"}] if with_system else []
    for i, reply in enumerate(replies):
        sent = conv.next_messages()
        assert list(sent) == [*expected, {"role": "user", "content": users[i]}]
        sent[-1]["content"] = "changed"  # what was handed out does not alias the history
        conv.add_reply(reply)
        expected += [{"role": "user", "content": users[i]}, {"role": "assistant", "content": reply}]
        assert conv.history == expected and conv.num_done == i + 1
    assert conv.done
    with pytest.raises(IndexError):
        conv.next_messages()


def test_think_times():
    assert think_times(0.0, 3, random.Random(0)) == [0.0, 0.0, 0.0]
    pauses = think_times(2.0, 4000, random.Random(0))
    assert 1.8 < sum(pauses) / len(pauses) < 2.2 and min(pauses) >= 0
    with pytest.raises(ValueError):
        think_times(-1.0, 1, random.Random(0))


def _rec(req_id: int, ttft: float, ok: bool = True, prompt: int = 10, **tags) -> RequestRecord:
    return RequestRecord(
        req_id=req_id, tenant="t", submit_s=0.0, end_s=ttft + 1.0,
        chunk_times_s=(ttft,) if ok else (), chunk_tokens=(1,) if ok else (),
        num_prompt_tokens=prompt, error="" if ok else "boom", extra=tags,
    )  # fmt: skip


def test_ttft_split_and_turns():
    records = [
        _rec(0, 0.5, turn=1, conversation=0, prompt=100),
        _rec(1, 0.1, turn=2, conversation=0, prompt=150),
        _rec(2, 0.7, turn=1, conversation=1, prompt=100),
        _rec(3, 0.3, turn=2, conversation=1, prompt=170),
        _rec(4, 0.2, turn=3, conversation=1, prompt=210),
        _rec(5, 9.0, ok=False, turn=3, conversation=0),
    ]
    split = ttft_split(records, "multi-turn")
    assert list(split) == ["first", "later"]
    assert split["first"]["ttft"]["p50_ms"] == pytest.approx(600.0)
    assert split["later"]["num_requests"] == 4 and split["later"]["num_ok"] == 3
    assert split["later"]["ttft"]["max_ms"] == pytest.approx(300.0)  # the failure is left out
    turns = by_turn(records)
    assert list(turns) == ["1", "2", "3"]
    assert turns["2"]["mean_prompt_tokens"] == pytest.approx(160.0)
    groups = ttft_split([_rec(0, 0.4, group=0, group_rank=0), _rec(1, 0.1, group=0, group_rank=1)],
                        "shared-prefix")  # fmt: skip
    assert groups["first"]["ttft"]["p50_ms"] == pytest.approx(400.0)
    assert groups["later"]["ttft"]["p50_ms"] == pytest.approx(100.0)


def _metrics(prefix: str, queries: float | None, hits: float | None, name: str = "") -> Snapshot:
    lines = [f'{prefix}:generation_tokens_total{{model_name="m"}} 10']
    if queries is not None:
        lines.append(f'{prefix}:{name}prefix_cache_queries_total{{engine="0"}} {queries}')
    if hits is not None:
        lines.append(f'{prefix}:{name}prefix_cache_hits_total{{engine="0"}} {hits}')
    return Snapshot.from_text("\n".join(lines))


@pytest.mark.parametrize("prefix,name", [("vllm", ""), ("vllm", "gpu_"), ("hipfire", "")])
def test_prefix_cache_hit_rate_over_the_run(prefix, name):
    d = summarize_delta(_metrics(prefix, 1000, 200, name), _metrics(prefix, 5000, 3200, name))
    assert d["prefix_cache_counters"] is True
    assert (d["prefix_cache_queries"], d["prefix_cache_hits"]) == (4000, 3000)
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert prefix_hit(d) == "0.750"
    idle = summarize_delta(_metrics(prefix, 10, 5, name), _metrics(prefix, 10, 5, name))
    assert idle["prefix_cache_counters"] and idle["prefix_cache_hit_rate"] is None


def test_absent_prefix_cache_counters_are_absent_not_zero():
    for after in (_metrics("vllm", None, None), _metrics("vllm", 100, None)):
        d = summarize_delta(_metrics("vllm", None, None), after)
        assert d["prefix_cache_counters"] is False
        assert d["prefix_cache_hit_rate"] is None and d["prefix_cache_queries"] is None
        assert prefix_hit(d) == "absent"
    assert prefix_hit(None) == "-"
