"""Greedy outputs through the real engine and executor do not depend on the speculation policy
(the scheduler's per-round AR/SPEC choices and depths only change the speed)."""

from __future__ import annotations

import pytest

from hipfire_serve import LLM, SamplingParams
from tests.fixtures.tiny_models import make_tiny_model

PROMPTS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "The quick brown fox jumps over the lazy dog. " * 2,
    "1, 2, 3, 4, 5, 6,",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3", seed=5)


def test_greedy_outputs_identical_across_policies(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs, drafted = {}, {}
    for spec_mode, draft in (("ar", "none"), ("spec", "ngram"), ("adaptive", "ngram")):
        llm = LLM(
            str(model_dir),
            device="cpu",
            dtype="float32",
            draft=draft,
            spec_mode=spec_mode,
            spec_depth=5,
            max_concurrency=2,
        )
        results = llm.generate(PROMPTS, params)
        outputs[spec_mode] = [r.outputs[0].token_ids for r in results]
        drafted[spec_mode] = sum(r.outputs[0].num_draft_tokens for r in results)
        sched = llm.engine.scheduler
        assert sched.num_running == 0 and sched.kv.num_free == sched.kv.num_total
    assert drafted["ar"] == 0 and drafted["spec"] > 0 and drafted["adaptive"] > 0
    assert outputs["spec"] == outputs["ar"]
    assert outputs["adaptive"] == outputs["ar"]
    assert all(len(toks) == 24 for toks in outputs["ar"])
