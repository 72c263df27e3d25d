"""A hybrid (Qwen3.5) target through the engine: the recurrent state comes out of the KV budget,
prefix caching is off for it, and a shared prompt served twice gives AR's greedy tokens."""

from __future__ import annotations

import pytest

from executor.recurrent_state import RecurrentStates
from hipfire_serve import LLM, SamplingParams
from hipfire_serve.config import EngineConfig
from hipfire_serve.engine_setup import build_engine_parts
from tests.executor.tiny_qwen3_5 import make_tiny_qwen3_5

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


def _config(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), device="cpu", dtype="float32", draft="none", spec_mode="ar")
    return EngineConfig(**{**base, **kw})


def test_the_state_is_taken_from_the_kv_budget(hybrid_dir):
    parts = build_engine_parts(_config(hybrid_dir, kv_cache_memory="8MiB", max_concurrency=4))
    state = RecurrentStates.bytes_per_slot(parts.target.config, parts.target.dtype.itemsize)
    assert state > 0
    more = build_engine_parts(_config(hybrid_dir, kv_cache_memory="8MiB", max_concurrency=64))
    assert more.executor.kv.num_blocks < parts.executor.kv.num_blocks
    with pytest.raises(ValueError, match="recurrent state") as err:
        build_engine_parts(_config(hybrid_dir, kv_cache_memory=f"{state}B", max_concurrency=2))
    assert "\n" not in str(err.value)


def test_prefix_caching_is_off_and_outputs_match_ar(hybrid_dir):
    shared = list(range(5, 5 + 70))  # past several KV blocks
    prompts = [[*shared, 90], [*shared, 91]]
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(str(hybrid_dir), device="cpu", dtype="float32", draft="ngram", spec_mode="spec")
    assert not llm.engine.scheduler.config.enable_prefix_caching
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], p)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    ar = LLM(str(hybrid_dir), device="cpu", dtype="float32", draft="none", spec_mode="ar")
    expected = [o.outputs[0].token_ids for o in ar.generate(prompts, p)]
    assert first[0] == expected[0] and second == expected
