"""Prefix caching through the offline API: outputs token-identical with the cache on and off
(AR and speculating), the scheduler's counters, `cache_salt` isolation, idle accounting with
only unreferenced blocks cached, and the serve command's flags."""

from __future__ import annotations

import pytest

from hipfire_serve import LLM, SamplingParams
from hipfire_serve.server.config import resolve
from hipfire_serve.server.protocol import (
    CompletionRequest,
    RequestError,
    decode_request,
    sampling_params,
)

SYSTEM = "You are a helpful assistant. Answer briefly and exactly.\n" * 3
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "def add(a, b):", "Why is the sky blue?"]


def _llm(model_dir, **kw):
    kw.setdefault("draft", "none")
    return LLM(str(model_dir), device="cpu", dtype="float32", block_size=8, **kw)


def _idle(llm):
    s = llm.engine.scheduler
    assert s.num_running == 0 and s.num_waiting == 0 and not llm.engine.has_unfinished()
    assert s.kv.num_free == s.kv.num_total and s.kv.num_evictable == s.kv.num_cached
    s.kv.check()


def _hits(llm) -> int:
    return sum(llm.engine.scheduler.stats.prefix_cache_hits.values())


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_outputs_are_identical_with_and_without_the_cache(model_dir, draft):
    """A shared system prompt, the same prompts again, and a second turn of a conversation."""
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = {}
    for caching in (False, True):
        llm = _llm(
            model_dir,
            draft=draft,
            spec_mode="adaptive" if draft != "none" else "ar",
            enable_prefix_caching=caching,
            max_concurrency=2,
        )
        prompts = [SYSTEM + q for q in QUESTIONS]
        first = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
        again = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
        turn2 = prompts[0] + first[0] + "\nAnd 3 + 3?"
        second = llm.generate(turn2, greedy)[0].outputs[0].text
        outputs[caching] = (first, again, second)
        assert first == again
        _idle(llm)
        stats = llm.engine.scheduler.stats
        assert stats.enable_prefix_caching == caching
        assert (_hits(llm) > 0) == caching
        if caching:  # every prompt after the first two found the system prompt at least
            num_tokens = len(llm.tokenizer.encode(SYSTEM))
            assert _hits(llm) >= (2 * len(QUESTIONS) - 1) * (num_tokens // 8 - 1) * 8
            assert stats.prefix_cache_queries["default"] >= _hits(llm)
    assert outputs[True] == outputs[False]


def test_a_cache_salt_shares_only_with_its_own_salt(model_dir):
    llm = _llm(model_dir)
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = SYSTEM + QUESTIONS[0]
    llm.generate(prompt, SamplingParams(**params))
    assert _hits(llm) == 0
    llm.generate(prompt, SamplingParams(cache_salt="alice", **params))
    assert _hits(llm) == 0  # the unsalted blocks are not alice's
    llm.generate(prompt, SamplingParams(cache_salt="alice", **params))
    assert _hits(llm) > 0
    _idle(llm)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(prompt, SamplingParams(cache_salt="", **params))


def test_the_serve_flags_and_the_request_field():
    engine, _ = resolve([], environ={})
    assert engine.enable_prefix_caching and not engine.shared_prefix_cache
    engine, _ = resolve(["--no-enable-prefix-caching", "--shared-prefix-cache"], environ={})
    assert not engine.enable_prefix_caching and engine.shared_prefix_cache
    for body, salt in ((b'{"prompt": "x", "cache_salt": "s1"}', "s1"), (b'{"prompt": "x"}', None)):
        req = decode_request(body, CompletionRequest)
        assert sampling_params(req, max_tokens=4, logprobs=None).cache_salt == salt
    req = decode_request(b'{"prompt": "x", "cache_salt": ""}', CompletionRequest)
    with pytest.raises(RequestError) as err:
        sampling_params(req, max_tokens=4, logprobs=None)
    assert err.value.param == "cache_salt"
