"""Speculative exactness: whatever the per-round AR/SPEC choices and depths, greedy output equals
plain AR greedy token for token, and sampled output has the target's distribution.

Rounds are driven by the real `Scheduler` with a policy that draws every request's mode and depth
at random each round (so requests switch between AR and SPEC all the time and drafters have to
catch up), through the real `RoundExecutor`, with the ngram drafter, the draft-model drafter
(an unrelated tiny model, a near copy of the target, and the target drafting for itself so that
whole chains are accepted) and a random block drafter reading the target's hidden states. The
KV block pool must be back to idle after every run.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.drafters.block_drafter import BlockDrafter
from executor.drafters.block_model import load_block_drafter
from executor.drafters.draft_model import DraftModelDrafter
from executor.drafters.ngram import NgramDrafter
from executor.drafters.rerank import OnlineReranker
from executor.drafters.synthetic import SyntheticDrafter
from executor.kv_cache import KVCache
from executor.loader import load_model
from executor.model import Model
from executor.round_executor import RoundExecutor
from kernels.kv_fp8 import FP8_KV_DTYPE
from scheduler.plan import Mode, RoundPlan, SamplingSpec
from scheduler.policy import Decision
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter
from tests.fixtures.tiny_models import make_tiny_model

ACCEPTANCE_PROFILE = Path(__file__).resolve().parents[2] / "scheduler/profiles/acceptance.json"
BLOCK_SIZE = 8
MAX_MODEL_LEN = 160
SPEC_DEPTH = 16  # rows per speculating request at most: up to 15 drafts
BLOCK_LEN = 8  # the block drafter's block: up to 7 drafts
GREEDY = SamplingSpec(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning
    threads make each op milliseconds slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def perturbed(model: Model, rel_noise: float, seed: int) -> Model:
    """A copy of `model` whose matrices carry Gaussian noise of `rel_noise` times their std: a
    draft model that agrees with the target often but not always."""
    gen = torch.Generator().manual_seed(seed)

    def noisy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.dim() != 2:
            return t
        return t + rel_noise * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)

    w = model.weights
    layers = tuple(
        dataclasses.replace(
            lw, **{f.name: noisy(getattr(lw, f.name)) for f in dataclasses.fields(lw)}
        )
        for lw in w.layers
    )
    weights = dataclasses.replace(w, embed=noisy(w.embed), lm_head=noisy(w.lm_head), layers=layers)
    return Model(model.config, weights, device=model.device, dtype=model.dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Model]:
    return build_models(tmp_path_factory)


def build_models(tmp_path_factory) -> dict[str, Model]:
    """The target, an unrelated draft model of another architecture (it almost never agrees
    with the target), and a near copy of the target (it accepts about a fifth of its drafts at
    the random depths of these runs, whole runs of up to 13)."""
    target_dir = make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0)
    draft_dir = make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen3", seed=1)
    target = load_model(target_dir, dtype="float32")
    return {
        "target": target,
        "draft": load_model(draft_dir, dtype="float32"),
        "near": perturbed(target, 0.05, seed=1),
        "block": tiny_block_drafter(tmp_path_factory, target),
    }


def tiny_block_drafter(tmp_path_factory, target: Model):
    """A random block drafter of `target` (it reads every one of the target's layers)."""
    path = make_tiny_block_drafter(
        tmp_path_factory.mktemp("block"), target.config, seed=7, block_size=BLOCK_LEN
    )
    return load_block_drafter(path, target)


# -- harness ----------------------------------------------------------------------------------
class RandomDepthPolicy:
    """Every round, each decoding request speculates with probability `p_spec`, at a depth drawn
    uniformly from 2..spec_depth. Depths are not capped by the tokens a request has left, so
    chains run past max_tokens and stops land inside accepted runs."""

    name = "random-depth"

    def __init__(self, rng: np.random.Generator, p_spec: float = 0.5, max_drafts: int = 0):
        self.rng = rng
        self.p_spec = p_spec
        self.max_drafts = max_drafts  # 0: up to spec_depth - 1

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        spec = (self.rng.random(n) < self.p_spec) & view.may_spec
        max_drafts = self.max_drafts or view.max_drafts
        depth_rows = self.rng.integers(2, max_drafts + 2, n)  # [n] in 2..max_drafts + 1
        return Decision(np.where(spec, depth_rows - 1, 0).astype(np.int64), "random depths")


@dataclass
class RunLog:
    outputs: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    num_drafted: int = 0
    num_accepted: int = 0
    longest_accepted: int = 0
    num_spec_rows: int = 0
    num_ar_rows: int = 0
    # rounds whose emitted tokens were cut by a stop, by finish reason ("stop", "length")
    stops_inside_run: dict[str, int] = field(default_factory=dict)
    mode_switches: int = 0
    num_preemptions: int = 0
    num_catchup_rows: int = 0  # rows the drafter caught up on in its proposals
    reranker_stats: dict = field(default_factory=dict)  # a block drafter's re-ranker, if any
    prefix_cache_hits: int = 0  # tokens requests started from cached blocks, resumed included
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # of the chosen tokens


class MisreportingDrafter(DraftModelDrafter):
    """Broken on purpose: drafts from q but reports q**3 (renormalised) as its distribution, so
    rejection sampling corrects for the wrong q. The sampled test must catch it."""

    def propose(self, requests, greedy, defer=False):
        batch = super().propose(requests, greedy, defer)
        if batch.probs is not None:
            cubed = batch.probs**3
            batch.probs = cubed / cubed.sum(dim=-1, keepdim=True)
        return batch


def make_drafter(
    kind: str, models: dict[str, Model], num_blocks: int, max_slots: int, graphs: str = "off"
):
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter()
    if kind == "synthetic":
        return SyntheticDrafter(ACCEPTANCE_PROFILE, "code", seed=0)
    if kind in ("block", "block-rerank"):
        return BlockDrafter(
            models["block"],
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_slots=max_slots,
            max_model_len=MAX_MODEL_LEN + SPEC_DEPTH,
            graphs=graphs,
            reranker=OnlineReranker() if kind == "block-rerank" else None,
        )
    model = models[{"draft-self": "target", "draft-near": "near"}.get(kind, "draft")]
    cls = MisreportingDrafter if kind == "draft-misreported" else DraftModelDrafter
    return cls(
        model,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_slots=max_slots,
        max_model_len=MAX_MODEL_LEN + SPEC_DEPTH,
    )


def make_executor(
    target: Model,
    drafter,
    num_blocks: int,
    max_slots: int,
    follows_prefill: bool = False,
    graphs: str = "off",
) -> RoundExecutor:
    return RoundExecutor(
        target,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_slots=max_slots,
        max_model_len=MAX_MODEL_LEN + SPEC_DEPTH,
        drafter=drafter,
        drafter_follows_prefill=follows_prefill,
        graphs=graphs,
    )


def run_requests(
    models: dict[str, Model],
    specs: list[RequestSpec],
    drafter_kind: str,
    rng: np.random.Generator,
    *,
    p_spec: float = 0.5,
    max_drafts: int = 0,
    max_slots: int = 4,
    num_blocks: int = 160,
    max_prefill_tokens: int = 24,
    on_plan=None,
    follows_prefill: bool = False,
    graphs: str = "off",
    enable_prefix_caching: bool = True,
    arrive_at: dict[int, int] | None = None,
    abort_at: dict[int, int] | None = None,
) -> RunLog:
    """Runs `specs` to completion; asserts the KV pool is back to idle at the end (the prefix
    cache holding only blocks nobody references). `arrive_at`: req id -> the round it is added
    before (others at the start); `abort_at`: req id -> the round it is aborted before."""
    drafter = make_drafter(drafter_kind, models, num_blocks, max_slots, graphs)
    has_drafter = drafter is not None
    sched = Scheduler(
        SchedulerConfig(
            max_concurrency=max_slots,
            max_queue=len(specs),
            spec_mode="adaptive" if has_drafter else "ar",
            spec_depth=BLOCK_LEN if isinstance(drafter, BlockDrafter) else SPEC_DEPTH,
            block_size=BLOCK_SIZE,
            max_prefill_tokens=max_prefill_tokens,
            max_model_len=MAX_MODEL_LEN,
            has_drafter=has_drafter,
            draft_kv_lookahead=getattr(drafter, "kv_lookahead", 0),
            drafter_follows_prefill="on" if follows_prefill else "off",
            enable_prefix_caching=enable_prefix_caching,
        ),
        num_kv_blocks=num_blocks,
        policy=RandomDepthPolicy(rng, p_spec, max_drafts) if has_drafter else None,
    )
    ex = make_executor(models["target"], drafter, num_blocks, max_slots, follows_prefill, graphs)
    assert ex.follow_prefill == (follows_prefill and drafter_kind.startswith("draft"))
    arrive_at = arrive_at or {}
    abort_at = abort_at or {}
    later = {s.req_id: s for s in specs if arrive_at.get(s.req_id, 0) > 0}
    for s in specs:
        if s.req_id not in later:
            sched.add_request(s)
    log = RunLog(outputs={s.req_id: [] for s in specs})
    if drafter is not None:
        propose = drafter.propose

        def counted(requests, greedy, defer=False):
            batch = propose(requests, greedy, defer)  # deferred as the executor asks

            def count(b):
                log.num_catchup_rows += b.extra.get("num_catchup_rows", 0)

            if batch.resolver is None:
                count(batch)
            else:
                resolver = batch.resolver
                batch.resolver = lambda b: (resolver(b), count(b))
            return batch

        drafter.propose = counted
    last_mode: dict[int, Mode] = {}
    num_rounds = 0
    while sched.has_work() or later:
        num_rounds += 1
        assert num_rounds < 2000, "requests did not finish"
        for req_id in [r for r in later if arrive_at[r] <= num_rounds]:
            sched.add_request(later.pop(req_id))
        for req_id, at in abort_at.items():
            if at == num_rounds:
                sched.abort(req_id)
                log.finish.setdefault(req_id, "abort")
        plan = sched.plan(float(num_rounds))
        if on_plan is not None:
            on_plan(plan, sched)
        result = ex.run(plan)
        emitted = {r.req_id: len(r.token_ids) for r in result.reqs}
        for r in plan.reqs:
            if r.mode == Mode.SPEC:
                log.num_spec_rows += r.num_new
            elif r.mode == Mode.AR:
                log.num_ar_rows += 1
            if r.mode != Mode.PREFILL:
                if r.req_id in last_mode and last_mode[r.req_id] != r.mode:
                    log.mode_switches += 1
                last_mode[r.req_id] = r.mode
        for rr in result.reqs:
            log.longest_accepted = max(log.longest_accepted, rr.num_accepted)
        for d in sched.update(result, float(num_rounds)):
            log.outputs[d.req_id] += d.token_ids
            if d.logprobs:
                log.logprobs.setdefault(d.req_id, []).extend(lp.logprob for lp in d.logprobs)
            log.num_drafted += d.num_drafted
            log.num_accepted += d.num_accepted
            if d.finish_reason is not None:
                log.finish[d.req_id] = d.finish_reason
                if len(d.token_ids) < emitted[d.req_id]:
                    reason = d.finish_reason
                    log.stops_inside_run[reason] = log.stops_inside_run.get(reason, 0) + 1
        if isinstance(drafter, DraftModelDrafter):
            # the scheduler's drafter lag (what the cost model prices) is the draft model's:
            # the committed positions it has no draft KV for
            slots = np.flatnonzero(sched._slot_table.decoding)
            assert np.array_equal(
                drafter.kv_len[slots] + sched._slot_table.drafter_lag[slots],
                sched._slot_table.num_computed[slots],
            ), num_rounds
    stats = sched.stats
    log.num_preemptions = stats.num_preemptions
    log.prefix_cache_hits = sum(stats.prefix_cache_hits.values()) + stats.prefix_cache_resumed_hits
    if getattr(drafter, "reranker", None) is not None:
        log.reranker_stats = drafter.reranker.stats()
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.kv.num_free == sched.kv.num_total
    assert sched.kv.num_evictable == sched.kv.num_cached
    sched.kv.check()
    return log


def random_prompt(rng: np.random.Generator, vocab: int) -> tuple[int, ...]:
    """A prompt with some repetition in it, so prompt lookup finds matches."""
    length = int(rng.integers(3, 40))
    motif = rng.integers(1, vocab, int(rng.integers(2, 6))).tolist()
    tokens = []
    while len(tokens) < length:
        tokens += motif if rng.random() < 0.4 else rng.integers(1, vocab, 3).tolist()
    return tuple(tokens[:length])


def random_specs(rng: np.random.Generator, vocab: int, samplings) -> list[RequestSpec]:
    """One request per sampling spec: a random prompt and 10-39 tokens to generate."""
    return [
        RequestSpec(
            req_id=i,
            prompt_token_ids=random_prompt(rng, vocab),
            sampling=sampling,
            max_tokens=int(rng.integers(10, 40)),
        )
        for i, sampling in enumerate(samplings)
    ]


def ar_reference(models, prompts: list[tuple[int, ...]], max_tokens: list[int]) -> list[list[int]]:
    specs = [
        RequestSpec(req_id=i, prompt_token_ids=p, sampling=GREEDY, max_tokens=m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    log = run_requests(models, specs, "none", np.random.default_rng(0), enable_prefix_caching=False)
    assert log.num_spec_rows == 0
    return [log.outputs[i] for i in range(len(prompts))]


def with_stops(rng, ref: list[int], max_tokens: int, req_id: int, prompt) -> tuple:
    """A request whose stop token (EOS or a stop id) ends it at a random point of its AR
    reference, with the output greedy decoding must then produce."""
    spec = dict(req_id=req_id, prompt_token_ids=prompt, sampling=GREEDY, max_tokens=max_tokens)
    expected, finish = list(ref), "length"
    k = int(rng.integers(0, len(ref)))
    if rng.random() < 0.6 and ref[k] not in ref[:k]:
        if rng.random() < 0.5:
            spec["eos_token_ids"] = (ref[k],)
        else:
            spec["stop_token_ids"] = (ref[k],)
        expected, finish = ref[: k + 1], "stop"
    return RequestSpec(**spec), expected, finish


# -- greedy exactness -------------------------------------------------------------------------
DRAFTERS = ("ngram", "draft-other", "draft-near", "draft-self", "block", "block-rerank")


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_greedy_spec_equals_ar_under_random_modes(models, drafter_kind):
    vocab = models["target"].config.vocab_size
    totals = RunLog()
    for trial in range(3):
        rng = np.random.default_rng([trial, DRAFTERS.index(drafter_kind)])
        num_reqs = 6
        prompts = [random_prompt(rng, vocab) for _ in range(num_reqs)]
        max_tokens = [int(rng.integers(1, 48)) for _ in range(num_reqs)]
        refs = ar_reference(models, prompts, max_tokens)
        specs, expected, finish = zip(
            *(with_stops(rng, refs[i], max_tokens[i], i, prompts[i]) for i in range(num_reqs))
        )
        log = run_requests(models, list(specs), drafter_kind, rng)
        for i in range(num_reqs):
            assert log.outputs[i] == expected[i], f"trial {trial} request {i}"
            assert log.finish[i] == finish[i]
        totals.num_drafted += log.num_drafted
        totals.num_accepted += log.num_accepted
        totals.num_spec_rows += log.num_spec_rows
        totals.num_ar_rows += log.num_ar_rows
        for reason, n in log.stops_inside_run.items():
            totals.stops_inside_run[reason] = totals.stops_inside_run.get(reason, 0) + n
        totals.mode_switches += log.mode_switches
        totals.longest_accepted = max(totals.longest_accepted, log.longest_accepted)
    # the runs exercised what they claim to
    assert totals.num_spec_rows > 0 and totals.num_ar_rows > 0 and totals.mode_switches > 10
    if drafter_kind == "block-rerank":  # random weights rarely agree: the learner ran, though
        assert log.reranker_stats["rows_reranked"] > 0, log.reranker_stats
        assert log.reranker_stats["rows_covered"] > 0, log.reranker_stats
    else:
        assert totals.num_accepted > 0
    if drafter_kind not in ("draft-other", "block", "block-rerank"):
        # an unrelated random model rarely agrees with the target; the others have accepted
        # runs long enough for stops to fall inside them
        assert sum(totals.stops_inside_run.values()) > 0
    if drafter_kind == "draft-near":
        assert 0.1 * totals.num_drafted < totals.num_accepted < 0.9 * totals.num_drafted
    if drafter_kind == "draft-self":
        # drafting with the target itself: (nearly) every draft is accepted, long chains pass
        assert totals.num_accepted >= 0.97 * totals.num_drafted
        assert totals.longest_accepted >= 10
        # both EOS / stop ids and max_tokens cut accepted runs
        assert totals.stops_inside_run.get("stop", 0) > 0
        assert totals.stops_inside_run.get("length", 0) > 0


@pytest.fixture(scope="module")
def fp8_models(models) -> dict:
    """The same models with FP8 KV caches (`--kv-cache-dtype fp8`; scales 1.0): the target's,
    the draft models' and the block drafter's context cache."""

    def fp8(model: Model) -> Model:
        out = copy.copy(model)
        out.kv_cache_dtype = FP8_KV_DTYPE
        return out

    out = {name: fp8(m) for name, m in models.items() if name != "block"}
    out["block"] = copy.copy(models["block"])
    out["block"].decoder = fp8(models["block"].decoder)
    kv = KVCache.for_model(out["target"], num_blocks=1, block_size=BLOCK_SIZE)
    assert kv.k[0].dtype == FP8_KV_DTYPE and models["target"].kv_cache_dtype == torch.float32
    return out


@pytest.mark.parametrize("drafter_kind", ("ngram", "draft-near", "draft-self", "block"))
def test_greedy_spec_equals_ar_with_fp8_kv(fp8_models, drafter_kind):
    """Exactness holds whatever the cache stores: a position's K/V are quantized the same way
    whichever route computed them, and every row reads them back the same way."""
    vocab = fp8_models["target"].config.vocab_size
    num_drafted = num_accepted = 0
    for trial in range(2):
        rng = np.random.default_rng([trial, 7])
        prompts = [random_prompt(rng, vocab) for _ in range(5)]
        max_tokens = [int(rng.integers(8, 40)) for _ in range(5)]
        refs = ar_reference(fp8_models, prompts, max_tokens)
        specs, expected, finish = zip(
            *(with_stops(rng, refs[i], max_tokens[i], i, prompts[i]) for i in range(5))
        )
        log = run_requests(fp8_models, list(specs), drafter_kind, rng)
        for i in range(5):
            assert log.outputs[i] == expected[i], f"trial {trial} request {i}"
            assert log.finish[i] == finish[i]
        num_drafted += log.num_drafted
        num_accepted += log.num_accepted
    assert num_drafted > 0 and (drafter_kind == "block" or num_accepted > 0)


def test_greedy_spec_equals_ar_when_requests_are_preempted(models):
    """A KV pool too small for all requests: the scheduler preempts and later recomputes a
    request (its context now holds outputs), and the drafter starts that slot over."""
    rng = np.random.default_rng(1)
    vocab = models["target"].config.vocab_size
    prompts = [random_prompt(rng, vocab) for _ in range(6)]
    max_tokens = [int(rng.integers(20, 60)) for _ in range(6)]
    refs = ar_reference(models, prompts, max_tokens)
    specs = [
        RequestSpec(req_id=i, prompt_token_ids=p, sampling=GREEDY, max_tokens=m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    log = run_requests(models, specs, "draft-near", rng, num_blocks=24)
    assert log.num_preemptions > 0
    for i in range(len(specs)):
        assert log.outputs[i] == refs[i], f"request {i}"


@pytest.mark.parametrize("num_blocks", [160, 24])
def test_greedy_spec_equals_ar_with_the_draft_model_following_prefills(models, num_blocks):
    """The draft model computes each prefill chunk's KV in the chunk's round (chunks of 24
    rows, several per round), so a request's first decode round finds its drafter caught up on
    the prompt; with 24 blocks requests are preempted and recomputed too. Outputs are those of
    plain AR decoding either way."""
    rng = np.random.default_rng([7, num_blocks])
    vocab = models["target"].config.vocab_size
    prompts = [random_prompt(rng, vocab) + random_prompt(rng, vocab) for _ in range(6)]
    max_tokens = [int(rng.integers(20, 60)) for _ in range(6)]
    refs = ar_reference(models, prompts, max_tokens)
    specs = [
        RequestSpec(req_id=i, prompt_token_ids=p, sampling=GREEDY, max_tokens=m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    catchup_rows = {}
    for follows in (True, False):
        prefilled, first_lags = set(), []

        def watch(plan, sched, prefilled=prefilled, first_lags=first_lags):
            """The drafter's lag at each request's first decode round after a prefill."""
            for req_id, slot in zip(plan.decode.req_ids.tolist(), plan.decode.slots.tolist()):
                if req_id in prefilled:
                    prefilled.discard(req_id)
                    first_lags.append(int(sched._slot_table.drafter_lag[slot]))
            prefilled.update(q.req_id for q in plan.prefills)

        log = run_requests(
            models,
            specs,
            "draft-near",
            np.random.default_rng([7, num_blocks, follows]),
            num_blocks=num_blocks,
            follows_prefill=follows,
            on_plan=watch,
        )
        if num_blocks == 24:
            assert log.num_preemptions > 0
        assert log.num_spec_rows > 0 and log.num_accepted > 0
        for i in range(len(specs)):
            assert log.outputs[i] == refs[i], f"follows {follows}, request {i}"
        assert len(first_lags) >= len(specs)
        catchup_rows[follows] = log.num_catchup_rows
        if follows:
            assert first_lags == [0] * len(first_lags)
            # only tokens decoded plainly, and the last draft of a fully accepted chain (one
            # row at most per speculating request-round, which verifies at least 2 rows)
            assert log.num_catchup_rows <= log.num_ar_rows + log.num_spec_rows // 2
        else:  # the whole prompt (and outputs, after a preemption) to catch up
            assert min(first_lags) >= min(len(p) for p in prompts)
    assert catchup_rows[False] > catchup_rows[True] + sum(len(p) for p in prompts) // 2
    # rounds that follow and rounds that do not, alternating (the auto mode's per-round
    # decisions): a prompt is followed as far as its chunks continue the draft KV
    script = itertools.cycle([True, False])

    def alternate(plan, sched):
        sched._follows_prefill = lambda prefills: next(script)

    log = run_requests(
        models,
        specs,
        "draft-near",
        np.random.default_rng([8, num_blocks]),
        num_blocks=num_blocks,
        follows_prefill=True,
        on_plan=alternate,
    )
    for i in range(len(specs)):
        assert log.outputs[i] == refs[i], f"alternating, request {i}"
    assert catchup_rows[True] < log.num_catchup_rows < catchup_rows[False]


def test_draft_model_writes_stay_inside_blocks_the_plan_allocated(models):
    """The drafter's KV writes land only in blocks the scheduler allocated to the request, at
    the right table index, below num_computed + 1 + num_draft."""
    rng = np.random.default_rng(7)
    vocab = models["target"].config.vocab_size
    specs = random_specs(rng, vocab, [GREEDY] * 6)
    state: dict = {}
    num_checked = [0]

    def on_plan(plan: RoundPlan, sched):
        state["plan"], state["sched"] = plan, sched

    draft_model = models["draft"]
    original_forward = draft_model.forward

    def checked_forward(input_ids, meta, k_caches, v_caches):
        plan, sched = state["plan"], state["sched"]
        owner = {}  # block id -> (plan req, index in its table)
        for r in plan.reqs:
            for idx, b in enumerate(sched.kv.blocks_of(r.req_id)):
                owner[b] = (r, idx)
        positions = meta.positions.tolist()
        for pos, s in zip(positions, meta.slot_mapping.tolist()):
            r, idx = owner[s // BLOCK_SIZE]
            assert r.mode == Mode.SPEC
            assert idx == pos // BLOCK_SIZE and s % BLOCK_SIZE == pos % BLOCK_SIZE
            assert pos < r.num_computed + 1 + r.num_draft
            num_checked[0] += 1
        return original_forward(input_ids, meta, k_caches, v_caches)

    draft_model.forward = checked_forward
    try:
        run_requests(models, specs, "draft-other", rng, max_slots=3, num_blocks=64, on_plan=on_plan)
    finally:
        del draft_model.forward
    assert num_checked[0] > 100


# -- sampled exactness ------------------------------------------------------------------------
SMALL_VOCAB = 8
NUM_SAMPLES = 3000
TEMPERATURE = 0.8
SAMPLED_TOKENS = 3  # the joint distribution of the first three emitted tokens is compared
ALPHA = 1e-3  # significance: a correct implementation fails one seed in a thousand


def shrink_vocab(model: Model, vocab_size: int) -> Model:
    """The same network over its first `vocab_size` tokens only (embedding and head rows)."""
    w = model.weights
    weights = dataclasses.replace(
        w, embed=w.embed[:vocab_size].clone(), lm_head=w.lm_head[:vocab_size].clone()
    )
    config = dataclasses.replace(model.config, vocab_size=vocab_size)
    return Model(config, weights, device=model.device, dtype=model.dtype)


@pytest.fixture(scope="module")
def small_models(models, tmp_path_factory) -> dict[str, Model]:
    small = {name: shrink_vocab(models[name], SMALL_VOCAB) for name in ("target", "draft")}
    small["block"] = tiny_block_drafter(tmp_path_factory, small["target"])
    return small


def target_joint(model: Model, prompt: list[int], num_tokens: int, temperature: float):
    """Exact probability of every continuation of `num_tokens` tokens: [vocab ** num_tokens],
    by plain AR forwards of the target (one sequence at a time, no paging tricks)."""
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    for _ in range(num_tokens):
        nxt = {}
        for prefix, p in probs.items():
            dist = next_token_probs(model, prompt + list(prefix), temperature)
            for t in range(vocab):
                nxt[(*prefix, t)] = p * float(dist[t])
        probs = nxt
    return probs


def next_token_probs(model: Model, tokens: list[int], temperature: float) -> torch.Tensor:
    from executor.kv_cache import KVCache
    from executor.model import AttnMetadata

    n = len(tokens)
    num_blocks = -(-n // BLOCK_SIZE)
    kv = KVCache.allocate(
        model.config,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        dtype=model.dtype,
        device=model.device,
    )
    meta = AttnMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
    )
    hidden = model.forward(torch.tensor(tokens), meta, kv.k, kv.v)
    logits = model.logits(hidden[-1:])[0].double()
    return torch.softmax(logits / temperature, dim=-1)


def chi_square_pvalue(counts: dict, probs: dict, num_samples: int) -> tuple[float, int]:
    """Pearson chi-square of observed counts against exact cell probabilities; cells with an
    expected count under 5 are pooled into one. Returns (p-value, degrees of freedom)."""
    stat, dof = 0.0, -1
    pooled_obs = pooled_exp = 0.0
    for cell, p in probs.items():
        expected = p * num_samples
        observed = counts.get(cell, 0)
        if expected < 5.0:
            pooled_obs += observed
            pooled_exp += expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    # P(chi2_dof >= stat) = Q(dof / 2, stat / 2), the regularised upper incomplete gamma
    pvalue = torch.special.gammaincc(
        torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    )
    return float(pvalue), dof


def sample_joint(models: dict[str, Model], drafter_kind: str) -> tuple[float, int, RunLog]:
    """Runs NUM_SAMPLES seeded requests of SAMPLED_TOKENS tokens after a fixed prompt, every
    decode round speculating; returns the chi-square p-value of the emitted sequences against
    the target's exact joint distribution."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so prompt lookup drafts 3, 1, 2 ...
    specs = [
        RequestSpec(
            req_id=i,
            prompt_token_ids=tuple(prompt),
            # no seed of its own: rejection sampling verifies (a seeded request's drafts are
            # coupled to the target's draws instead, see the seeded test below)
            sampling=SamplingSpec(temperature=TEMPERATURE),
            max_tokens=SAMPLED_TOKENS,
        )
        for i in range(NUM_SAMPLES)
    ]
    log = run_requests(
        models,
        specs,
        drafter_kind,
        np.random.default_rng(11),
        p_spec=1.0,
        max_drafts=SAMPLED_TOKENS,
        max_slots=64,
        num_blocks=192,
        max_prefill_tokens=512,
    )
    counts: dict[tuple[int, ...], int] = {}
    for out in log.outputs.values():
        assert len(out) == SAMPLED_TOKENS
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    probs = target_joint(models["target"], prompt, SAMPLED_TOKENS, TEMPERATURE)
    pvalue, dof = chi_square_pvalue(counts, probs, NUM_SAMPLES)
    assert dof >= 20  # enough informative cells for the test to have power
    return pvalue, dof, log


@pytest.mark.parametrize("drafter_kind", ("ngram", "draft-other", "block"))
def test_sampled_spec_has_the_target_distribution(small_models, drafter_kind):
    pvalue, dof, log = sample_joint(small_models, drafter_kind)
    # speculation really happened, with accepted and rejected drafts
    assert log.num_drafted > NUM_SAMPLES
    assert 0 < log.num_accepted < log.num_drafted
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {dof} dof"


@pytest.mark.parametrize("drafter_kind", ("ngram", "draft-near", "draft-self", "block"))
def test_seeded_sampled_output_is_plain_decodings_whatever_the_route(models, drafter_kind):
    """A sampled request with its own seed gives the tokens plain decoding gives with that seed,
    under random AR/SPEC routes and depths, beside greedy and unseeded requests, with every
    drafter: its drafts are drawn with the target's own noise and verified against its draws."""
    vocab = models["target"].config.vocab_size
    rng = np.random.default_rng(21)
    samplings = [SamplingSpec(temperature=0.8, seed=40 + i, top_p=0.95) for i in range(4)]
    samplings += [GREEDY, SamplingSpec(temperature=1.0)]
    specs = random_specs(rng, vocab, samplings)
    want = run_requests(models, specs, "none", np.random.default_rng(0))
    got = run_requests(models, specs, drafter_kind, rng, p_spec=0.8)
    for i in range(5):  # the seeded and the greedy requests
        assert got.outputs[i] == want.outputs[i], f"request {i}"
    assert got.num_drafted > 0
    if drafter_kind in ("draft-near", "draft-self"):
        assert got.num_accepted > 0.2 * got.num_drafted


def test_sampled_check_catches_a_misreported_draft_distribution(small_models):
    pvalue, dof, _ = sample_joint(small_models, "draft-misreported")
    assert pvalue < ALPHA, f"chi-square p = {pvalue:.2e} over {dof} dof"


# -- drafts taken on the device ----------------------------------------------------------------
DEFERRED_WORKLOADS = {
    "greedy-and-sampled": [
        GREEDY,
        SamplingSpec(temperature=0.8, seed=11),
        SamplingSpec(temperature=1.0, seed=12),
        GREEDY,
    ],
    "penalised": [
        GREEDY,
        SamplingSpec(repetition_penalty=1.4, presence_penalty=0.6),
        SamplingSpec(temperature=0.7, seed=5, frequency_penalty=0.5),
        SamplingSpec(temperature=0.9, seed=6),
    ],
}


@pytest.mark.parametrize("workload", sorted(DEFERRED_WORKLOADS))
def test_deferred_drafts_change_no_output(models, monkeypatch, workload):
    """The executor takes a draft model's drafts on the device: the round's batch is built while
    the chain runs and the drafts are copied into its rows there (deferred). Runs with the
    drafts waited for on the host first give the same tokens, for greedy, seeded sampled and
    penalised requests (penalties count the drafts on the host, so those rounds take them at
    launch)."""
    vocab = models["target"].config.vocab_size
    samplings = DEFERRED_WORKLOADS[workload]
    original = DraftModelDrafter.propose
    launch = RoundExecutor.launch
    penalised_launches = []

    def checked_launch(self, plan):
        # penalties read the drafts on the host at launch: they must be there, not placeholders
        p = launch(self, plan)
        if p.drafts is not None and self.table.penalised[p.batch.requests.slots].any():
            penalised_launches.append(p.drafts.tokens is not None)
        return p

    monkeypatch.setattr(RoundExecutor, "launch", checked_launch)
    runs, deferred = {}, {}
    for defer in (True, False):
        deferred[defer] = []

        def propose(self, requests, greedy, defer_asked=False, defer=defer):
            batch = original(self, requests, greedy, defer and defer_asked)
            deferred[defer].append(batch.tokens is None)
            return batch

        monkeypatch.setattr(DraftModelDrafter, "propose", propose)
        rng = np.random.default_rng(21)
        specs = random_specs(rng, vocab, samplings)
        log = run_requests(models, specs, "draft-near", rng, p_spec=0.8)
        runs[defer] = (log.outputs, log.num_drafted, log.num_accepted)
    assert runs[True] == runs[False]
    assert runs[True][2] > 0
    # deferred proposals reached the executor unresolved; without defer none did
    assert any(deferred[True]) and not any(deferred[False])
    if workload == "penalised":
        assert penalised_launches and all(penalised_launches)


# -- the block drafter's context ---------------------------------------------------------------
def reference_block_logits(models, context: list[int], block_len: int) -> torch.Tensor:
    """A block's draft logits [block_len - 1, vocab] from scratch: one fresh target forward over
    the committed context (but its last token) for the hidden states, then the block drafter's
    plain-torch one-request forward."""
    from executor.hidden_capture import HiddenCapture
    from executor.kv_cache import KVCache
    from executor.model import AttnMetadata

    target, block = models["target"], models["block"]
    n = len(context) - 1
    num_blocks = -(-n // BLOCK_SIZE)
    kv = KVCache.for_model(target, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    meta = AttnMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
    )
    capture = HiddenCapture.allocate(
        block.config.target_layer_ids,
        n,
        target.config.hidden_size,
        dtype=target.dtype,
        device=target.device,
    )
    dev = target.device
    meta = AttnMetadata(**{k: v.to(dev) for k, v in vars(meta).items() if v is not None})
    target.forward(torch.tensor(context[:-1], device=dev), meta, kv.k, kv.v, capture)
    features = block.project_context(capture.rows(n))
    positions = torch.arange(n + block_len, device=dev)
    return block.draft_block(features, positions[:n], context[-1], positions[n:])


def test_block_drafter_context_follows_every_round(models):
    """Whatever the rounds did before (prefill chunks, AR rounds, accepted and rejected drafts,
    preemption and recompute), every block the drafter proposes equals the block drafted from
    scratch over the committed context: its context K/V is never stale, never lags."""
    check_block_context(models)


def check_block_context(
    models, graphs: str = "off", tol: float = 1e-4, prompts=None, arrive_at=None
) -> RunLog:
    """Runs requests through random modes with the block drafter, checking every proposed block
    against `reference_block_logits`; outputs must equal AR's. The random drafter agrees with
    the target too rarely for accepted runs, so the logits it hands on favour the target's own
    continuation in most blocks (after the check). `prompts`: six prompts instead of random
    ones, `arrive_at` as in `run_requests`."""
    rng = np.random.default_rng(5)
    vocab = models["target"].config.vocab_size
    if prompts is None:
        prompts = [random_prompt(rng, vocab) for _ in range(6)]
    max_tokens = [int(rng.integers(40, 80)) for _ in range(6)]
    refs = ar_reference(models, prompts, max_tokens)
    full = [list(p) + r for p, r in zip(prompts, refs)]
    specs = [
        RequestSpec(req_id=i, prompt_token_ids=p, sampling=GREEDY, max_tokens=m)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    checked = {"blocks": 0}
    block_logits = BlockDrafter._block_logits
    propose = BlockDrafter.propose
    requests_of_round = []

    def checking(self, ids, meta, draft_rows):
        logits = block_logits(self, ids, meta, draft_rows)  # [E, vocab]
        cu = meta.cu_q_lens.tolist()
        e = 0
        for k, request in enumerate(requests_of_round[-1]):
            block_len = cu[k + 1] - cu[k]
            context = list(request.context)
            assert int(meta.seq_lens[k]) == len(context) - 1 + block_len
            ref = reference_block_logits(models, context, block_len)
            d = request.num_draft
            torch.testing.assert_close(logits[e : e + d], ref[:d], rtol=tol, atol=tol)
            checked["blocks"] += 1
            if rng.random() < 0.7:  # steer the drafts towards the target's continuation
                seq = next(f for f in full if f[: len(context)] == context)
                truth = seq[len(context) : len(context) + d]
                rows = torch.arange(e, e + len(truth), device=logits.device)
                truth_ids = torch.tensor(truth, dtype=torch.long, device=logits.device)
                logits[rows, truth_ids] += 1e4
            e += d
        return logits

    def remembering(self, requests, greedy, defer=False):
        requests_of_round.append(requests)
        return propose(self, requests, greedy, defer)

    BlockDrafter._block_logits = checking
    BlockDrafter.propose = remembering
    try:
        log = run_requests(
            models, specs, "block", rng, num_blocks=20, graphs=graphs, arrive_at=arrive_at
        )
    finally:
        BlockDrafter._block_logits = block_logits
        BlockDrafter.propose = propose
    for i in range(len(specs)):
        assert log.outputs[i] == refs[i], f"request {i}"
    assert log.num_preemptions > 0 and log.mode_switches > 10
    assert 0.3 * log.num_drafted < log.num_accepted < 0.95 * log.num_drafted
    assert checked["blocks"] > 30
    return log
