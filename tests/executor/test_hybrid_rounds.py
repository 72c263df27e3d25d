"""A hybrid target (tiny random Qwen3.5) through the real scheduler and round executor.

Greedy AR decoding equals transformers' own cached greedy decoding (prefill chunks crossing
the delta rule's chunks and the KV blocks, then 64 tokens); greedy speculation (ngram and a
draft model, modes and depths drawn at random every round) equals AR token for token; state
slots follow the request slots every round and are all idle once the requests are done,
through aborts and preemption. Prefix caching is off: a recurrent state cannot be shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from executor.drafters.base import DraftBatch
from executor.drafters.draft_model import DraftModelDrafter
from executor.drafters.ngram import NgramDrafter
from executor.loader import load_model
from executor.round_executor import RoundExecutor
from scheduler.plan import Mode, SamplingSpec
from scheduler.policy import Decision
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.executor.tiny_qwen3_5 import make_tiny_qwen3_5
from tests.fixtures.tiny_models import make_tiny_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 8
MAX_MODEL_LEN = 224
SPEC_DEPTH = 8
GREEDY = SamplingSpec(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype="float32")


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen3", seed=1))


class RandomModes:
    """Each round every decoding request speculates with probability `p_spec`, at a depth
    drawn from 1..max_drafts drafts."""

    name = "random-modes"

    def __init__(self, rng: np.random.Generator, p_spec: float):
        self.rng, self.p_spec = rng, p_spec

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        spec = (self.rng.random(n) < self.p_spec) & view.may_spec
        drafts = self.rng.integers(1, view.max_drafts + 1, n)
        return Decision(np.where(spec, drafts, 0).astype(np.int64), "random modes")


class OracleDrafter:
    """Drafts the AR reference's own continuation, broken at a random draft half the time:
    whole groups, none and every prefix length in between get accepted."""

    name = "oracle"
    has_probs = False

    def __init__(self, references: list[list[int]], vocab: int, seed: int):
        self.references, self.vocab = references, vocab
        self.rng = np.random.default_rng(seed)

    def setup(self, slot, context) -> None: ...

    def release(self, slot) -> None: ...

    def commit(self, slot, context, num_accepted, num_draft) -> None: ...

    def propose(self, requests, greedy, defer=False) -> DraftBatch:
        drafts = []
        for r in requests:
            n = len(r.context)
            ref = next(x for x in self.references if x[:n] == list(r.context))
            toks = (ref[n : n + r.num_draft] + [1] * r.num_draft)[: r.num_draft]
            if self.rng.random() < 0.5:
                j = int(self.rng.integers(0, r.num_draft))
                toks[j] = (toks[j] + 1) % self.vocab
            drafts.append(toks)
        return DraftBatch(tokens=drafts)


@dataclass
class Run:
    outputs: dict[int, list[int]]
    num_preemptions: int = 0
    outcomes: set[str] = field(default_factory=set)  # "none", "some", "all" drafts accepted


def run_rounds(
    target,
    specs: list[RequestSpec],
    drafter=None,
    *,
    p_spec: float = 0.7,
    seed: int = 0,
    max_slots: int = 4,
    num_blocks: int = 160,
    max_prefill_tokens: int = 48,
    abort_at: dict[int, int] | None = None,
) -> Run:
    """Runs `specs` to completion (`abort_at`: req id -> round it is aborted before); checks
    every round that exactly the held slots hold state, and that all is idle at the end."""
    sched = Scheduler(
        SchedulerConfig(
            max_concurrency=max_slots,
            max_queue=len(specs),
            spec_mode="adaptive" if drafter is not None else "ar",
            spec_depth=SPEC_DEPTH,
            block_size=BLOCK_SIZE,
            max_prefill_tokens=max_prefill_tokens,
            max_model_len=MAX_MODEL_LEN,
            has_drafter=drafter is not None,
            enable_prefix_caching=False,
        ),
        num_kv_blocks=num_blocks,
        policy=RandomModes(np.random.default_rng(seed), p_spec) if drafter is not None else None,
    )
    ex = RoundExecutor(
        target,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_slots=max_slots,
        max_model_len=MAX_MODEL_LEN + SPEC_DEPTH,
        drafter=drafter,
    )
    for s in specs:
        sched.add_request(s)
    run = Run(outputs={s.req_id: [] for s in specs})
    abort_at = abort_at or {}
    num_rounds = 0
    while sched.has_work():
        num_rounds += 1
        assert num_rounds < 1000, "requests did not finish"
        for req_id in [r for r, at in abort_at.items() if at == num_rounds]:
            sched.abort(req_id)
        plan = sched.plan(float(num_rounds))
        result = ex.run(plan)
        assert np.array_equal(ex.states.in_use, ex.table.slot_req >= 0), num_rounds
        assert ex.states.num_pending_journals == 0
        drafted = {r.req_id: r.num_draft for r in plan.reqs if r.mode == Mode.SPEC}
        for r in result.reqs:
            if r.req_id in drafted:
                a, d = r.num_accepted, drafted[r.req_id]
                run.outcomes.add("none" if a == 0 else "all" if a == d else "some")
        for d in sched.update(result, float(num_rounds)):
            run.outputs[d.req_id] += d.token_ids
    run.num_preemptions = sched.stats.num_preemptions
    assert sched.kv.num_free == sched.kv.num_total
    ex.apply_setup_release(sched.plan(float(num_rounds + 1)))  # the last releases
    assert ex.states.num_free == max_slots and not ex.states.in_use.any()
    return run


def repetitive_prompt(rng: np.random.Generator, vocab: int, length: int) -> tuple[int, ...]:
    """A prompt with repeated motifs, so prompt lookup finds matches."""
    motif = rng.integers(1, vocab, int(rng.integers(2, 6))).tolist()
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += motif if rng.random() < 0.5 else rng.integers(1, vocab, 3).tolist()
    return tuple(tokens[:length])


def greedy_specs(prompts, max_tokens, samplings=None) -> list[RequestSpec]:
    samplings = samplings or [GREEDY] * len(prompts)
    return [
        RequestSpec(req_id=i, prompt_token_ids=p, sampling=sp, max_tokens=m)
        for i, (p, m, sp) in enumerate(zip(prompts, max_tokens, samplings))
    ]


def hf_greedy(target_dir, prompt: tuple[int, ...], num_tokens: int) -> list[int]:
    """transformers' cached decoding: its chunked delta rule over the prompt, then steps."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    hf.eval()
    out, tokens = [], torch.tensor([prompt])
    cache = None
    with torch.no_grad():
        for _ in range(num_tokens):
            step = hf(tokens, cache=cache, use_cache=True)
            cache = step.cache
            tokens = step.logits[:, -1:].argmax(-1)  # [1, 1]
            out.append(int(tokens))
    return out


def test_greedy_decoding_equals_transformers(target_dir, target):
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(1, target.config.vocab_size, n).tolist()) for n in (5, 70, 131)]
    run = run_rounds(target, greedy_specs(prompts, [64] * 3))
    for i, p in enumerate(prompts):
        assert run.outputs[i] == hf_greedy(target_dir, p, 64), f"prompt of {len(p)}"


@pytest.mark.parametrize("drafter_kind", ["oracle", "ngram", "draft-model"])
def test_greedy_speculation_equals_ar(target, draft_model, drafter_kind):
    vocab = target.config.vocab_size
    outcomes: set[str] = set()
    for trial in range(2):
        rng = np.random.default_rng([trial, 1])
        prompts = [repetitive_prompt(rng, vocab, int(rng.integers(3, 60))) for _ in range(5)]
        max_tokens = rng.integers(10, 40, len(prompts)).tolist()
        ref = run_rounds(target, greedy_specs(prompts, max_tokens)).outputs
        if drafter_kind == "oracle":
            drafter = OracleDrafter([list(p) + ref[i] for i, p in enumerate(prompts)], vocab, trial)
        elif drafter_kind == "ngram":
            drafter = NgramDrafter()
        else:
            drafter = DraftModelDrafter(
                draft_model,
                num_blocks=160,
                block_size=BLOCK_SIZE,
                max_slots=4,
                max_model_len=MAX_MODEL_LEN + SPEC_DEPTH,
            )
        run = run_rounds(target, greedy_specs(prompts, max_tokens), drafter, seed=trial)
        assert run.outputs == ref, f"trial {trial}"
        outcomes |= run.outcomes
    assert outcomes, "nobody speculated"
    if drafter_kind == "oracle":  # rollbacks to a group's start, its middle, and none at all
        assert outcomes == {"none", "some", "all"}


def test_seeded_sampled_speculation_equals_ar(target):
    """A seeded sampled request's drafts are matched against the target's own seeded draws:
    its text is plain decoding's whatever the route, so a state left wrong by a rollback
    shows as a different draw."""
    vocab = target.config.vocab_size
    rng = np.random.default_rng(9)
    prompts = [repetitive_prompt(rng, vocab, int(rng.integers(3, 40))) for _ in range(4)]
    max_tokens = rng.integers(15, 40, len(prompts)).tolist()
    samplings = [SamplingSpec(temperature=0.9, seed=20 + i) for i in range(len(prompts))]
    specs = greedy_specs(prompts, max_tokens, samplings)
    ref = run_rounds(target, specs).outputs
    drafter = OracleDrafter([list(p) + ref[i] for i, p in enumerate(prompts)], vocab, 0)
    run = run_rounds(target, specs, drafter)
    assert run.outputs == ref
    assert {"none", "some", "all"} <= run.outcomes


def test_state_slots_are_idle_after_aborts_and_preemption(target):
    rng = np.random.default_rng(5)
    vocab = target.config.vocab_size
    prompts = [repetitive_prompt(rng, vocab, int(rng.integers(20, 50))) for _ in range(6)]
    max_tokens = rng.integers(30, 60, len(prompts)).tolist()
    ref = run_rounds(target, greedy_specs(prompts, max_tokens)).outputs
    run = run_rounds(
        target,
        greedy_specs(prompts, max_tokens),
        NgramDrafter(),
        num_blocks=24,
        abort_at={1: 3, 4: 12},
    )
    assert run.num_preemptions > 0
    for i in (0, 2, 3, 5):
        assert run.outputs[i] == ref[i], f"request {i}"
    assert len(run.outputs[1]) < max_tokens[1] and len(run.outputs[4]) < max_tokens[4]
