"""Structured outputs and logit_bias through the offline API (tiny model, CPU): JSON that parses
and validates against its schema, greedy and sampled, with speculation off and on (prompt
lookup, a draft model, a block drafter); choices, regexes and Lark grammars; the same greedy
text whatever the route; errors that name the field; the pool back to idle."""

from __future__ import annotations

import json
import re

import pytest

from hipfire_serve import LLM, SamplingParams
from hipfire_serve.types import StructuredOutputsParams

PROMPT = "Describe a pet as JSON: "
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}


def check_schema(doc) -> None:
    """SCHEMA's keywords, spelled out."""
    assert isinstance(doc, dict) and set(doc) == {"name", "age", "kind", "tags"}
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8
    assert type(doc["age"]) is int and 0 <= doc["age"] <= 30
    assert doc["kind"] in ("cat", "dog", "fish")
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 2
    assert all(t in ("a", "b") for t in doc["tags"])


def _llm(model_dir, **kw):
    kw.setdefault("draft", "none")
    return LLM(str(model_dir), device="cpu", dtype="float32", **kw)


def _idle(llm):
    s = llm.engine.scheduler
    assert s.num_running == 0 and s.num_waiting == 0 and not llm.engine.has_unfinished()
    assert s.kv.num_free == s.kv.num_total
    assert llm.engine.executor.constraints.num_active == 0


@pytest.fixture(scope="module")
def drafters(model_dir, tmp_path_factory):
    from executor.loader import load_model
    from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter
    from tests.fixtures.tiny_models import make_tiny_model

    config = load_model(model_dir).config
    draft_dir = make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen3", seed=8)
    block_dir = make_tiny_block_drafter(tmp_path_factory.mktemp("block"), config, seed=2)
    return {
        "none": "none",
        "ngram": "ngram",
        "draft-model": str(draft_dir),
        "block": str(block_dir),
    }


def _json(**kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw
    )


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft-model", "block"])
def test_json_schema_output_parses_and_validates(model_dir, drafters, drafter):
    spec = drafter != "none"
    llm = _llm(model_dir, draft=drafters[drafter], spec_mode="spec" if spec else "ar", spec_depth=4)
    params = [
        _json(temperature=0.0),
        _json(temperature=1.0),
        _json(temperature=0.8, seed=3),
        _json(n=2, temperature=0.9, top_p=0.9),
    ]
    outputs = llm.generate([PROMPT, "x", PROMPT * 2, "hello"], params)
    choices = [c for out in outputs for c in out.outputs]
    assert len(choices) == 5
    for c in choices:
        assert c.finish_reason == "stop", c.text
        check_schema(json.loads(c.text))
    if spec:
        assert sum(c.num_draft_tokens for c in choices) > 0
    _idle(llm)


def test_greedy_json_is_the_same_text_with_and_without_speculation(model_dir, drafters):
    ar = _llm(model_dir).generate(PROMPT, _json(temperature=0.0))[0].outputs[0]
    for drafter in ("ngram", "draft-model", "block"):
        llm = _llm(model_dir, draft=drafters[drafter], spec_mode="spec", spec_depth=4)
        out = llm.generate(PROMPT, _json(temperature=0.0))[0].outputs[0]
        assert out.token_ids == ar.token_ids, drafter
        _idle(llm)


def test_a_preempted_request_resumes_its_grammar(model_dir):
    """A KV pool too small for every request at once: requests are preempted and recomputed,
    their matchers rebuilt from the outputs so far; the text is what an ample pool gives."""
    params = [_json(temperature=0.0), _json(temperature=0.7, seed=1)] * 3
    prompts = [f"{PROMPT}{i}" for i in range(6)]
    kw = dict(
        draft="ngram",
        spec_mode="spec",
        spec_depth=4,
        block_size=8,
        max_model_len=200,
        max_concurrency=4,
    )
    expected = [o.outputs[0].text for o in _llm(model_dir, **kw).generate(prompts, params)]
    small = _llm(model_dir, kv_cache_memory="112KiB", **kw)
    got = [o.outputs[0].text for o in small.generate(prompts, params)]
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert got == expected
    _idle(small)


def test_choice_regex_grammar_and_json_object(model_dir):
    llm = _llm(model_dir, draft="ngram", spec_mode="spec", spec_depth=4)

    def run(**so):
        params = SamplingParams(
            max_tokens=64, temperature=1.0, seed=5, structured_outputs=StructuredOutputsParams(**so)
        )
        return llm.generate("pick one: ", params)[0].outputs[0]

    choices = ["red", "green", "blue sky"]
    assert run(choice=choices).text in choices
    out = run(regex=r"[0-9]{3}-[a-z]{2,4}")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text) and out.finish_reason == "stop"
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
    assert re.fullmatch(r"yes|no|maybe [0-9]", run(grammar=lark).text)
    gbnf = 'root ::= "ab" [0-9]'
    assert re.fullmatch(r"ab[0-9]", run(grammar=gbnf).text)
    obj = run(json_object=True)
    if obj.finish_reason == "stop":  # an object may need more than 64 tokens
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    _idle(llm)


def test_constraint_errors_name_the_field(model_dir):
    llm = _llm(model_dir)

    def error(**kw) -> str:
        with pytest.raises(ValueError) as exc:
            llm.generate("x", SamplingParams(max_tokens=4, **kw))
        return str(exc.value)

    bad_type = {"type": "object", "properties": {"a": {"type": "strng"}}}
    assert error(structured_outputs=StructuredOutputsParams(json=bad_type)).startswith(
        "structured_outputs.json "
    )
    assert error(structured_outputs=StructuredOutputsParams(json="{nope")).startswith(
        "structured_outputs.json is not valid JSON"
    )
    assert error(structured_outputs=StructuredOutputsParams(regex="(")).startswith(
        "structured_outputs.regex "
    )
    assert error(structured_outputs=StructuredOutputsParams(grammar="start: nope")).startswith(
        "structured_outputs.grammar "
    )
    both = StructuredOutputsParams(regex="a", choice=["a"])
    assert error(structured_outputs=both).startswith("structured_outputs takes exactly one")
    assert error(structured_outputs=StructuredOutputsParams()).startswith(
        "structured_outputs takes exactly one"
    )
    assert error(structured_outputs=StructuredOutputsParams(choice=[])).startswith(
        "structured_outputs.choice must be"
    )
    named = StructuredOutputsParams(
        json=bad_type, source_field="response_format.json_schema.schema"
    )
    assert error(structured_outputs=named).startswith("response_format.json_schema.schema ")
    assert error(logit_bias={3: 100.5}).startswith("logit_bias values must be in [-100, 100]")
    assert error(logit_bias={-1: 1.0}).startswith("logit_bias keys must be token ids")
    assert error(logit_bias={i: 1.0 for i in range(301)}).startswith("logit_bias takes at most")
    vocab = llm.engine.target.config.vocab_size
    assert error(logit_bias={vocab: 1.0}).startswith(f"logit_bias token id {vocab} is outside")
    _idle(llm)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_logit_bias_bans_and_forces_under_speculation(model_dir, drafters, drafter):
    llm = _llm(model_dir, draft=drafters[drafter], spec_mode="spec", spec_depth=4)
    base = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    emitted = set(base[0].outputs[0].token_ids)
    ban = {t: -100.0 for t in emitted}
    for temperature in (0.0, 1.0):
        p = SamplingParams(max_tokens=24, temperature=temperature, ignore_eos=True, seed=2)
        banned = llm.generate(PROMPT, SamplingParams(**{**_fields(p), "logit_bias": ban}))
        assert not set(banned[0].outputs[0].token_ids) & emitted
        forced = llm.generate(PROMPT, SamplingParams(**{**_fields(p), "logit_bias": {7: 100}}))
        assert forced[0].outputs[0].token_ids == [7] * 24
    _idle(llm)


def _fields(p: SamplingParams) -> dict:
    import msgspec

    return msgspec.structs.asdict(p)


def test_logprobs_under_a_grammar_are_finite_and_masked(model_dir):
    """Forbidden tokens have probability 0: they are reported at the floor, never -inf (which
    JSON cannot carry), and the allowed ones hold the whole mass."""
    llm = _llm(model_dir, draft="ngram", spec_mode="spec", spec_depth=4)
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate("answer: ", params)[0].outputs[0]
    assert out.text in ("yes", "no") and out.logprobs
    for lp in out.logprobs:
        values = [v for _, v in lp.top]
        assert all(v >= -9999.0 for v in [lp.logprob, *values])
        allowed = [v for v in values if v > -9999.0]
        assert sum(2.718281828459045**v for v in allowed) == pytest.approx(1.0, abs=1e-4)
    _idle(llm)
