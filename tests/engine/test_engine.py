"""Engine behaviour through the offline API: seeds, n > 1, stop strings inside accepted runs,
logprobs, speculation figures, and resource accounting back to idle."""

from __future__ import annotations

import pytest

from hipfire_serve import LLM, SamplingParams

# A repetitive prompt: prompt lookup then drafts long runs that greedy decoding accepts.
PROMPT = "def add(a, b):\n    return a + b\n" * 3


def _llm(model_dir, **kw):
    kw.setdefault("draft", "none")
    return LLM(str(model_dir), device="cpu", dtype="float32", **kw)


def _idle(llm):
    s = llm.engine.scheduler
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv.num_free == s.kv.num_total
    assert not llm.engine.has_unfinished()


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir):
    llm = _llm(model_dir, max_concurrency=4)
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    batched = llm.generate(["x = 1", PROMPT, "hello"], [others, p, others])[1]
    assert alone == again == batched.outputs[0].token_ids
    _idle(llm)


def test_n_choices_use_derived_seeds(model_dir):
    llm = _llm(model_dir)
    p = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate(PROMPT, p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1  # different seeds per choice
    for i in range(3):  # choice i is the request with seed 7 + i
        single = llm.generate(
            PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=7 + i, ignore_eos=True)
        )[0]
        assert tuple(single.outputs[0].token_ids) == seqs[i]
    _idle(llm)


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_stop_string_inside_an_accepted_run(model_dir, draft):
    llm = _llm(model_dir, draft=draft, spec_mode="spec" if draft != "none" else "ar", spec_depth=8)
    base = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[
        0
    ].outputs[0]
    text = base.text
    assert len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    out = llm.generate(
        PROMPT, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # the token in which the stop string completes is the last one emitted
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])
    with_stop = llm.generate(
        PROMPT,
        SamplingParams(
            max_tokens=48,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    assert with_stop[0].outputs[0].text == text[: cut + len(stop)]
    _idle(llm)


def test_speculation_figures_and_logprobs(model_dir):
    llm = _llm(model_dir, draft="ngram", spec_mode="spec", spec_depth=6)
    out = llm.generate(
        PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    )[0].outputs[0]
    assert out.num_draft_tokens > 0
    assert 0 <= out.num_accepted_tokens <= out.num_draft_tokens
    assert len(out.logprobs) == len(out.token_ids) == 40
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1]
        assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely one
    plain = (
        _llm(model_dir)
        .generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
    )
    assert plain.token_ids == out.token_ids and plain.num_draft_tokens == 0
    _idle(llm)


def test_max_tokens_inside_an_accepted_run(model_dir):
    llm = _llm(model_dir, draft="ngram", spec_mode="spec", spec_depth=8)
    ref = (
        _llm(model_dir)
        .generate(PROMPT, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
    )
    for m in (1, 5, 13, 30):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))[
            0
        ].outputs[0]
        assert out.token_ids == ref.token_ids[:m] and out.finish_reason == "length"
    _idle(llm)


@pytest.fixture(scope="module")
def drafters(model_dir, tmp_path_factory):
    """The drafter kinds a seeded request may meet: prompt lookup, a draft model (a tiny model
    of the same vocabulary) and a random block drafter of the target."""
    from executor.loader import load_model
    from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter
    from tests.fixtures.tiny_models import make_tiny_model

    config = load_model(model_dir).config
    draft_dir = make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen3", seed=8)
    block_dir = make_tiny_block_drafter(tmp_path_factory.mktemp("block"), config, seed=2)
    return {"ngram": "ngram", "draft-model": str(draft_dir), "block": str(block_dir)}


@pytest.mark.parametrize("drafter", ["ngram", "draft-model", "block"])
def test_seeded_sampled_output_does_not_depend_on_the_route(model_dir, drafters, drafter):
    """A request with its own seed gets the text plain decoding gives with that seed under
    speculation on, off and auto, beside other requests: its drafts are drawn with the target's
    own noise and verified against its draws (prompt lookup's are matched against them)."""
    p = SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=11, ignore_eos=True)
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    ar = _llm(model_dir).generate(PROMPT, p)[0].outputs[0]
    for mode in ("spec", "adaptive"):
        llm = _llm(model_dir, draft=drafters[drafter], spec_mode=mode, spec_depth=4)
        batched = llm.generate(["x = 1", PROMPT, "hello"], [others, p, others])[1].outputs[0]
        assert batched.token_ids == ar.token_ids, mode
        if mode == "spec":
            assert batched.num_draft_tokens > 0
        _idle(llm)


def test_a_failing_round_fails_only_its_requests_and_the_engine_keeps_serving(model_dir):
    llm = _llm(model_dir, max_concurrency=2)
    engine = llm.engine
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], p)
    engine.step()  # a is prefilled and decoding
    real_launch = engine.executor.launch

    def broken(plan):
        raise RuntimeError("device fault")

    engine.executor.launch = broken
    outs = engine.step()
    engine.executor.launch = real_launch
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "error")]
    # later requests are served normally and resources come back
    out = llm.generate([[5, 6, 7]], p)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    _idle(llm)


def test_the_set_up_is_frozen_out_of_the_collectors_scans(model_dir):
    """After the warm-up the engine's long-lived objects sit in the collector's permanent
    generation: a full collection while serving does not walk them."""
    import gc

    gc.unfreeze()
    llm = _llm(model_dir, max_concurrency=2)
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}  # the generations the collector scans
    assert id(llm.engine.scheduler) not in tracked and id(llm.engine.executor) not in tracked
    out = llm.generate("x = 1", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
