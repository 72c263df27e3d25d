"""The engine's scheduler is replaced only through its public path: a cost model installed on an
idle engine, a throw-away scheduler for a measurement that puts the serving one back."""

from __future__ import annotations

from pathlib import Path

import pytest

from hipfire_serve import SamplingParams
from scheduler.cost_model import CostModel
from tests.engine.test_engine import PROMPT, _llm

PROFILES = Path(__file__).parents[2] / "scheduler" / "profiles"


def test_a_cost_model_is_installed_on_an_idle_engine_only(model_dir):
    engine = _llm(model_dir, draft="ngram").engine
    serving = engine.scheduler
    cost_model = CostModel.from_file(PROFILES / "h200-qwen3-8b.json")
    engine.install_cost_model(cost_model)
    assert engine.scheduler is not serving and engine.scheduler.cost_model is cost_model
    assert engine.scheduler.config.spec_mode == engine.config.spec_mode
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RuntimeError, match="idle"):
        engine.install_cost_model(None)
    while engine.has_unfinished():
        engine.step()
    engine.install_cost_model(None)


def test_a_throwaway_scheduler_serves_inside_the_block_and_the_serving_one_comes_back(model_dir):
    engine = _llm(model_dir, draft="ngram").engine
    serving = engine.scheduler
    with engine.throwaway_scheduler("spec") as measuring:
        assert engine.scheduler is measuring and measuring is not serving
        assert measuring.config.spec_mode == "spec"
        engine.add_request("m", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        assert any(r.num_spec for r in engine.stats().rounds)
    assert engine.scheduler is serving and not serving.has_work()
