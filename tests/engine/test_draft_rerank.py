"""`--draft-rerank`: a block drafter built with an online re-ranker, a one-line error with any
other drafter, and greedy output through the re-ranker equal to plain AR on the demo target."""

from __future__ import annotations

import pytest

from executor.drafters.block_drafter import BlockDrafter
from executor.drafters.rerank import OnlineReranker
from executor.model_config import load_model_config
from hipfire_serve import LLM, SamplingParams
from hipfire_serve.config import EngineConfig
from hipfire_serve.demo import demo_model_dir
from hipfire_serve.engine import Engine
from hipfire_serve.server.config import resolve
from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter

PROMPTS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "To be, or not to be, that is the question:",
    "class Stack:\n    def __init__(self):\n",
]


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    """A random block drafter of the demo target (block of 4 rows, three target layers)."""
    target = load_model_config(demo_model_dir())
    return make_tiny_block_drafter(
        tmp_path_factory.mktemp("block"),
        target,
        seed=4,
        dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 3, 5]},
    )


def _config(**kw) -> EngineConfig:
    kw.setdefault("spec_depth", 4)  # the block drafter's block
    return EngineConfig(model="demo", device="cpu", dtype="float32", kv_cache_memory="64MiB", **kw)


def test_the_flag_is_a_setting():
    engine, _ = resolve(["--draft-rerank"], environ={})
    assert engine.draft_rerank
    assert not resolve([], environ={})[0].draft_rerank


def test_the_flag_builds_a_reranking_block_drafter(block_dir):
    engine = Engine(_config(draft=str(block_dir), draft_rerank=True, max_concurrency=2))
    assert isinstance(engine.drafter, BlockDrafter)
    assert isinstance(engine.drafter.reranker, OnlineReranker)
    plain = Engine(_config(draft=str(block_dir), max_concurrency=2))
    assert isinstance(plain.drafter, BlockDrafter) and plain.drafter.reranker is None


@pytest.mark.parametrize("draft", ["none", "ngram", "chain"])
def test_the_flag_without_a_block_drafter_is_a_one_line_error(draft):
    if draft == "chain":
        from hipfire_serve.demo import demo_draft_dir

        draft = str(demo_draft_dir())
    with pytest.raises(ValueError, match="--draft-rerank") as err:
        Engine(_config(draft=draft, draft_rerank=True, max_concurrency=2))
    assert "\n" not in str(err.value)


def test_greedy_output_through_the_reranker_equals_ar(block_dir):
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ar = LLM("demo", device="cpu", dtype="float32", draft="none", spec_mode="ar")
    expected = [o.outputs[0].token_ids for o in ar.generate(PROMPTS, p)]
    llm = LLM(
        "demo",
        device="cpu",
        dtype="float32",
        draft=str(block_dir),
        draft_rerank=True,
        spec_mode="spec",
        spec_depth=4,
        max_concurrency=4,
    )
    reranker = llm.engine.drafter.reranker
    # Starting weights pick the drafter's top-1; a push towards rank 2 makes the re-ranker
    # change drafts, so its choices, not the drafter's, are what verification sees.
    reranker.w[1] += 4.0
    outs = llm.generate(PROMPTS, p)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].num_draft_tokens > 0 for o in outs)
    stats = reranker.stats()
    assert stats["rows_reranked"] > 0 and stats["rows_changed"] > 0
    s = llm.engine.scheduler
    assert s.num_running == 0 and s.kv.num_free == s.kv.num_total
