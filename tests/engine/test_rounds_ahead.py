"""Rounds ahead: an AR-only decode round is left running with its tokens counted, and the next
round is planned and launched before it finishes (its input tokens gathered on the device).
Nothing a client gets may change: outputs equal the engine's without overlapped rounds, for
greedy and seeded sampling, stops of every kind, logprobs and penalties (rounds that cannot
run ahead), arrivals, aborts and preemption; every slot and block comes back."""

from __future__ import annotations

import random

import pytest

from hipfire_serve import SamplingParams
from tests.engine.test_engine import PROMPT, _llm


def _idle(engine):
    s = engine.scheduler
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv.num_free == s.kv.num_total and s.num_free_slots == engine.config.max_concurrency
    assert not engine.has_unfinished()
    assert engine.round_in_flight is None and engine.executor.advanced_round is None


def _count_calls(engine):
    """Counts advanced rounds and the launches made while an advanced round was running."""
    counts = {"advanced": 0, "behind": 0, "overlapped": 0}
    ex = engine.executor
    advance, launch, finish = ex.advance, ex.launch, ex.finish

    def counted_finish(p):
        result = finish(p)
        counts["overlapped"] += result.overlapped
        return result

    def counted_advance(p):
        counts["advanced"] += 1
        return advance(p)

    def counted_launch(plan):
        counts["behind"] += ex.advanced_round is not None
        return launch(plan)

    ex.advance, ex.launch, ex.finish = counted_advance, counted_launch, counted_finish
    return counts


def _workload(seed: int, text: str):
    """Requests of mixed kinds: greedy and seeded sampling, stop strings, stop at max_tokens
    mid-stream, EOS allowed, logprobs, a penalty, n = 2."""
    rng = random.Random(seed)
    reqs = []
    for i in range(7):
        start = rng.randrange(0, 40)
        prompt = PROMPT[start : start + rng.randrange(8, 60)]
        kind = rng.choice(["greedy", "sampled", "stop", "eos", "logprobs", "penalty", "n2"])
        kw = dict(max_tokens=rng.randrange(1, 36), temperature=0.0, ignore_eos=True)
        if kind in ("sampled", "n2"):
            kw.update(temperature=0.9, top_p=0.95, seed=seed * 10 + i)
        if kind == "n2":
            kw["n"] = 2
        if kind == "stop":
            a = rng.randrange(10, 60)
            kw["stop"] = [text[a : a + 2]]
            kw["max_tokens"] = 40
        if kind == "eos":
            kw["ignore_eos"] = False
        if kind == "logprobs":
            kw["logprobs"] = 2
        if kind == "penalty":
            kw.update(repetition_penalty=1.3, presence_penalty=0.5)
        reqs.append((prompt, SamplingParams(**kw), rng.randrange(0, 6)))  # arrival step
    return reqs


def _run(engine, reqs):
    """Adds the requests at their arrival steps; returns what each step handed out per choice
    (text, token ids, logprob token ids) and the finish and stop reasons."""
    pieces: dict[tuple[str, int], list] = {}
    finals: dict[tuple[str, int], tuple] = {}
    step = added = 0
    while added < len(reqs) or engine.has_unfinished():
        for i, (prompt, params, arrive) in enumerate(reqs):
            if arrive == step:
                engine.add_request(f"r{i}", prompt, params)
                added += 1
        for out in engine.step():
            for o in out.outputs:
                key = (out.request_id, o.index)
                lps = [lp.token_id for lp in o.logprobs or []]
                pieces.setdefault(key, []).append((o.text, list(o.token_ids), lps))
                if o.finish_reason is not None:
                    finals[key] = (o.finish_reason, o.stop_reason)
        step += 1
        assert step < 2000
    assert len(finals) == sum(p.n for _, p, _ in reqs)
    return pieces, finals


def _joined(pieces):
    return {
        key: (
            "".join(t for t, _, _ in ps),
            [tok for _, ids, _ in ps for tok in ids],
            [lp for p in ps for lp in p[2]],
        )
        for key, ps in pieces.items()
    }


@pytest.fixture(scope="module")
def block_dir(model_dir, tmp_path_factory):
    """A random block drafter of the tiny target (block of 4 rows)."""
    from executor.loader import load_model
    from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter

    config = load_model(model_dir).config
    return make_tiny_block_drafter(tmp_path_factory.mktemp("block"), config, seed=2)


@pytest.mark.parametrize(
    ("seed", "spec_mode", "drafter"),
    [(s, m, "ngram" if m != "ar" else "none") for s in (0, 1, 4) for m in ("ar", "adaptive")]
    + [(2, "adaptive", "block")],
)
def test_rounds_ahead_change_no_output(model_dir, block_dir, seed, spec_mode, drafter):
    draft = str(block_dir) if drafter == "block" else drafter
    kw = dict(max_concurrency=4, spec_depth=4, draft=draft, spec_mode=spec_mode)
    base = _llm(model_dir, overlap_rounds=False, **kw)
    text = base.generate(PROMPT, SamplingParams(max_tokens=64, temperature=0.0))[0].outputs[0].text
    reqs = _workload(seed, text)
    want = _run(base.engine, reqs)
    llm = _llm(model_dir, overlap_rounds=True, **kw)
    counts = _count_calls(llm.engine)
    proposals = {"n": 0}
    if llm.engine.drafter is not None:
        propose = llm.engine.drafter.propose

        def counted_propose(*args, **kwargs):
            proposals["n"] += 1
            return propose(*args, **kwargs)

        llm.engine.drafter.propose = counted_propose
    got = _run(llm.engine, reqs)
    assert got[1] == want[1]  # finish and stop reasons
    if spec_mode == "ar":
        assert got[0] == want[0]  # every piece handed out, in the same steps
        assert counts["advanced"] > 0 and counts["behind"] > 0
        assert 0 < counts["overlapped"] <= counts["behind"]
    elif drafter == "block":
        # the block drafter draws sampled requests' drafts, so their tokens follow the route
        # (with the target's distribution either way): greedy outputs must match
        greedy = {f"r{i}" for i, (_, p, _) in enumerate(reqs) if p.temperature == 0.0}
        got_greedy = {k: v for k, v in _joined(got[0]).items() if k[0] in greedy}
        assert got_greedy == {k: v for k, v in _joined(want[0]).items() if k[0] in greedy}
        assert len(got_greedy) >= 3
        assert counts["advanced"] > 0 and proposals["n"] > 0
    else:  # the adaptive policy's route follows measured round times: compare whole outputs
        assert _joined(got[0]) == _joined(want[0])
    _idle(llm.engine)


def test_an_abort_while_a_round_runs_ahead_emits_nothing_more(model_dir):
    llm = _llm(model_dir, max_concurrency=3)
    engine = llm.engine
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for name in ("a", "b", "c"):
        engine.add_request(name, PROMPT[:20], p)
    for _ in range(5):
        engine.step()
    assert engine.round_in_flight is not None
    engine.abort("b")
    seen = []
    while engine.has_unfinished():
        seen += [out.request_id for out in engine.step()]
    assert "b" not in seen and {"a", "c"} <= set(seen)
    _idle(engine)


def test_preemption_with_rounds_ahead_keeps_outputs_exact(model_dir):
    """A KV cache too small for everyone: requests are preempted (by plans made while an
    advanced round still writes their KV) and recomputed; outputs equal plain greedy ones."""
    kw = dict(max_model_len=96, block_size=8, max_prefill_tokens=16)
    prompts = [PROMPT[: 20 + 7 * i] for i in range(6)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(model_dir, **kw).generate(prompts, greedy)]
    llm = _llm(model_dir, max_concurrency=4, kv_cache_memory="64KiB", **kw)
    counts = _count_calls(llm.engine)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert counts["behind"] > 0
    assert got == ref
    _idle(llm.engine)


def test_rounds_run_in_launch_order_and_the_next_launches_first(model_dir):
    """The advanced round finishes after the next round's launch and before its finish."""
    llm = _llm(model_dir, max_concurrency=2)
    engine = llm.engine
    ex = engine.executor
    events = []
    launch, finish = ex.launch, ex.finish

    def traced_launch(plan):
        events.append(("launch", plan.round_id))
        return launch(plan)

    def traced_finish(p):
        events.append(("finish", p.plan.round_id))
        return finish(p)

    ex.launch, ex.finish = traced_launch, traced_finish
    llm.generate([PROMPT[:10], PROMPT[5:30]], SamplingParams(max_tokens=12, ignore_eos=True))
    finishes = [r for e, r in events if e == "finish"]
    assert finishes == sorted(finishes)  # launch order
    pos = {e: i for i, e in enumerate(events)}
    overlapped = [r for e, r in events if e == "finish" and ("launch", r + 1) in pos]
    assert any(pos[("launch", r + 1)] < pos[("finish", r)] for r in overlapped)
