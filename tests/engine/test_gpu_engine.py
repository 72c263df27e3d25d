"""GPU check of the whole engine (scheduler, round executor with its packed uploads and
launch/finish split, graphs, drafters): greedy outputs under speculation equal plain AR
outputs, for prompt lookup and for a draft model, and resources return to idle."""

from __future__ import annotations

import pytest

from hipfire_serve import LLM, SamplingParams
from tests.fixtures.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "hello world, " * 6,
    "x = 1\ny = 2\n",
    "the quick brown fox " * 4,
    "1, 2, 3, 4, 5, 6, ",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("t"), "qwen3", seed=3)
    draft = make_tiny_model(tmp_path_factory.mktemp("d"), "qwen3", seed=4)
    return target, draft


def _outputs(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("graphs", ["lazy", "off"])
def test_greedy_speculation_equals_ar_on_gpu(model_dirs, graphs):
    target, draft = model_dirs
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_concurrency=4, graphs=graphs)
    ref = _outputs(LLM(str(target), draft="none", spec_mode="ar", **common), params)
    for drafter in ("ngram", str(draft)):
        llm = LLM(str(target), draft=drafter, spec_mode="spec", spec_depth=6, **common)
        assert _outputs(llm, params) == ref, drafter
        s = llm.engine.scheduler
        assert s.num_running == 0 and s.num_waiting == 0
        assert s.kv.num_free == s.kv.num_total


def _counting(fn):
    def counted(*args):
        counted.calls += 1
        return fn(*args)

    counted.calls = 0
    return counted


def test_rounds_ahead_change_no_output_on_gpu(model_dirs):
    """Rounds launched ahead (input tokens gathered from the running round on the device,
    graph replays back to back) emit what rounds one after the other emit, greedy and seeded
    sampled, with requests arriving while rounds run ahead."""
    target, _ = model_dirs
    common = dict(device="cuda", dtype="float32", max_concurrency=3, graphs="lazy")
    for params in (
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
    ):
        ref = _outputs(LLM(str(target), draft="none", overlap_rounds=False, **common), params)
        llm = LLM(str(target), draft="none", overlap_rounds=True, **common)
        ex = llm.engine.executor
        ex.advance = _counting(ex.advance)
        assert _outputs(llm, params) == ref
        assert ex.advance.calls > 0
        assert llm.engine.scheduler.kv.num_free == llm.engine.scheduler.kv.num_total
