"""Prefix caching changes no output: greedy tokens through the real Scheduler and RoundExecutor
with a shared system prompt, repeated prompts, a second conversation turn, aborts, preemption
and speculation on and off (prompt lookup, a draft model following prefills or catching up, a
block drafter) equal those of plain AR decoding without the cache. The harness asserts the KV
pool back to idle, the cache holding only unreferenced blocks, and a draft model's lag."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.plan import SamplingSpec
from scheduler.request import RequestSpec
from tests.executor.test_spec_exactness import (
    BLOCK_SIZE,
    build_models,
    check_block_context,
    random_prompt,
    run_requests,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory)


# greedy, with the chosen tokens' logprobs: KV that is wrong somewhere moves them even where
# the tiny model's argmax holds
GREEDY_LOGPROBS = SamplingSpec(temperature=0.0, logprobs=0)


def specs_of(prompts, max_tokens) -> list[RequestSpec]:
    return [
        RequestSpec(req_id=i, prompt_token_ids=tuple(p), sampling=GREEDY_LOGPROBS, max_tokens=m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]


def reference(models, prompts, max_tokens) -> tuple[list[list[int]], list[list[float]]]:
    """Plain AR greedy outputs and their logprobs without the prefix cache."""
    log = run_requests(
        models,
        specs_of(prompts, max_tokens),
        "none",
        np.random.default_rng(0),
        enable_prefix_caching=False,
    )
    assert log.prefix_cache_hits == 0
    n = len(prompts)
    return [log.outputs[i] for i in range(n)], [log.logprobs[i] for i in range(n)]


def shared_prefix_workload(models, seed: int):
    """Prompts after one system prompt of 3 blocks (one of them that prompt alone, one twice:
    whole-prompt hits recompute their last block), unrelated ones, and a second turn of the
    first conversation (its prompt, its reference answer, a new question) arriving once the
    first turn is done. Returns prompts, max_tokens, arrivals and the reference outputs with
    their logprobs."""
    rng = np.random.default_rng(seed)
    vocab = models["target"].config.vocab_size
    system = tuple(rng.integers(1, vocab, 3 * BLOCK_SIZE).tolist())
    prompts = [system + random_prompt(rng, vocab)[:20] for _ in range(4)]
    prompts += [system, system, prompts[1], random_prompt(rng, vocab)]
    max_tokens = [int(rng.integers(6, 30)) for _ in prompts]
    # the first turn ends on a block boundary: its last token has no KV, so the block holding
    # it must not be cached (the second turn recomputes that position)
    max_tokens[0] += -(len(prompts[0]) + max_tokens[0]) % BLOCK_SIZE
    arrive_at = {i: 2 * i for i in range(2, len(prompts))}  # later ones find cached blocks
    refs, logprobs = reference(models, prompts, max_tokens)
    turn2 = prompts[0] + tuple(refs[0]) + random_prompt(rng, vocab)[:8]
    prompts.append(turn2)
    max_tokens.append(8)
    arrive_at[len(prompts) - 1] = 90  # (the first turn has finished by then)
    ref2, logprobs2 = reference(models, [turn2], [8])
    return prompts, max_tokens, arrive_at, (refs + ref2, logprobs + logprobs2)


def check_outputs(log, refs, aborted=()):
    tokens, logprobs = refs
    for i, ref in enumerate(tokens):
        n = len(ref)
        if i in aborted and log.finish.get(i) == "abort":
            n = len(log.outputs[i])
        assert log.outputs[i] == ref[:n], f"request {i}"
        np.testing.assert_allclose(log.logprobs.get(i, [])[:n], logprobs[i][:n], atol=1e-4)


@pytest.mark.parametrize(
    ("drafter_kind", "follows"),
    [
        ("none", False),
        ("ngram", False),
        ("draft-near", False),
        ("draft-near", True),
        ("block", False),
    ],
)
def test_greedy_outputs_with_the_cache_equal_ar_without_it(models, drafter_kind, follows):
    prompts, max_tokens, arrive_at, refs = shared_prefix_workload(models, seed=11)
    aborted = {3: 9, 6: 13}  # aborted at these rounds, mid-prefill or decoding
    log = run_requests(
        models,
        specs_of(prompts, max_tokens),
        drafter_kind,
        np.random.default_rng([11, len(drafter_kind), follows]),
        max_slots=3,
        arrive_at=arrive_at,
        abort_at=aborted,
        follows_prefill=follows,
    )
    check_outputs(log, refs, aborted)
    # the system prompt's 3 blocks at least once, the whole first turn for the second
    assert log.prefix_cache_hits >= 3 * BLOCK_SIZE + len(prompts[0]) + len(refs[0][0]) - BLOCK_SIZE
    if drafter_kind != "none":
        assert log.num_spec_rows > 0 and log.num_ar_rows > 0


def test_greedy_outputs_with_the_cache_equal_ar_under_preemption(models):
    """A pool too small for the batch: requests are preempted, their recompute starts from what
    is still cached (their own blocks, the system prompt's), blocks are evicted to make room."""
    prompts, max_tokens, arrive_at, refs = shared_prefix_workload(models, seed=12)
    log = run_requests(
        models,
        specs_of(prompts, max_tokens),
        "draft-near",
        np.random.default_rng(12),
        max_slots=4,
        num_blocks=14,
        arrive_at=arrive_at,
    )
    check_outputs(log, refs)
    assert log.num_preemptions > 0 and log.prefix_cache_hits > 0


def test_block_drafter_proposals_are_right_after_a_prefix_hit(models):
    """Blocks cached by a target forward hold the block drafter's context at their positions:
    every block proposed for a request that started after cached blocks equals the one drafted
    from scratch over its whole context."""
    rng = np.random.default_rng(13)
    vocab = models["target"].config.vocab_size
    system = tuple(rng.integers(1, vocab, 3 * BLOCK_SIZE).tolist())
    prompts = [system + random_prompt(rng, vocab)[:12] for _ in range(5)] + [system]
    log = check_block_context(models, prompts=prompts, arrive_at={i: 3 * i for i in range(6)})
    assert log.prefix_cache_hits >= 5 * 3 * BLOCK_SIZE - BLOCK_SIZE
