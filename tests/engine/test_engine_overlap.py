"""The engine's overlapped loop: a round's outputs are collected while the next round runs, so
stop strings and aborts take effect one round late on the device but never in what clients
get: output is truncated exactly, the request is not planned again, nothing is emitted after an
abort, and every slot and block comes back."""

from __future__ import annotations

import pytest

from hipfire_serve import SamplingParams
from tests.engine.test_engine import PROMPT, _llm


def _idle(engine):
    s = engine.scheduler
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv.num_free == s.kv.num_total and s.num_free_slots == engine.config.max_concurrency
    assert not engine.has_unfinished()


class _Trace:
    """Records, per round, the requests planned and the tokens each emitted on the device."""

    def __init__(self, engine):
        self.planned: dict[int, set[int]] = {}
        self.emitted: dict[int, dict[int, list[int]]] = {}
        plan, finish = engine.scheduler.plan, engine.executor.finish

        def traced_plan(now):
            p = plan(now)
            self.planned[p.round_id] = {q.req_id for q in p.reqs}
            return p

        def traced_finish(pending):
            result = finish(pending)
            self.emitted[result.round_id] = {r.req_id: list(r.token_ids) for r in result.reqs}
            return result

        engine.scheduler.plan = traced_plan
        engine.executor.finish = traced_finish


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_stop_string_in_round_n_ends_the_request_before_round_n_plus_2(model_dir, draft):
    llm = _llm(model_dir, draft=draft, spec_mode="spec" if draft != "none" else "ar", spec_depth=4)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = llm.generate(PROMPT, greedy)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    trace = _Trace(engine)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    engine.add_request("s", PROMPT, params)
    engine.add_request("other", PROMPT, greedy)  # keeps the batch busy after "s" ends
    req_id = engine._requests.requests["s"].choice_ids[0]
    final = None
    pieces = []
    num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "s":
                pieces.append(out.outputs[0].text)
                num_tokens += len(out.outputs[0].token_ids)
                if out.finished:
                    final = out.outputs[0]
    assert final is not None and final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(pieces) == text[:cut]
    # the round whose tokens complete the stop string, from the device's side
    emitted = 0
    stop_round = None
    for round_id in sorted(trace.emitted):
        emitted += len(trace.emitted[round_id].get(req_id, []))
        if stop_round is None and emitted >= num_tokens:
            stop_round = round_id
    assert stop_round is not None and num_tokens < len(base.token_ids)
    later = [r for r, reqs in trace.planned.items() if r >= stop_round + 2 and req_id in reqs]
    assert later == []
    _idle(engine)


@pytest.mark.parametrize("overlap_rounds", [False, True])
def test_a_request_aborted_between_steps_emits_nothing_more(model_dir, overlap_rounds):
    llm = _llm(model_dir, max_concurrency=2, overlap_rounds=overlap_rounds)
    engine = llm.engine
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], p)
    engine.add_request("b", [5, 6, 8], p)
    for _ in range(4):  # both decode; "a" has a round's tokens not yet handed out
        engine.step()
    if overlap_rounds:  # a round of both still runs (advanced)
        in_flight = engine.round_in_flight
        assert in_flight is not None and in_flight.plan.num_reqs == 2
    else:  # a round's deltas wait to be collected
        assert engine._uncollected is not None and len(engine._uncollected) == 2
    engine.abort("a")
    seen = []
    while engine.has_unfinished():
        seen += [out.request_id for out in engine.step()]
    assert "a" not in seen and "b" in seen
    _idle(engine)


def test_stop_strings_aborts_and_preemption_together_keep_outputs_exact(model_dir):
    """A small KV cache (requests are preempted and recomputed), prompt-lookup speculation,
    stop strings and an abort, all through the overlapped loop: every finished output equals
    its request's plain greedy output cut at its stop string, and resources come back."""
    kw = dict(max_model_len=96, block_size=8, max_prefill_tokens=16, spec_depth=4)
    ref = _llm(model_dir, **kw)
    prompts = [PROMPT[: 20 + 7 * i] for i in range(6)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    texts = [o.outputs[0].text for o in ref.generate(prompts, greedy)]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]
    llm = _llm(
        model_dir, draft="ngram", spec_mode="spec", max_concurrency=4, kv_cache_memory="64KiB", **kw
    )
    engine = llm.engine
    for i, (prompt, stop) in enumerate(zip(prompts, stops)):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
        engine.add_request(f"r{i}", prompt, params)
    pieces: dict[str, list[str]] = {f"r{i}": [] for i in range(6)}
    finish = {}
    num_steps = 0
    while engine.has_unfinished():
        num_steps += 1
        if num_steps == 6:
            engine.abort("r5")
        for out in engine.step():
            assert out.request_id not in finish
            pieces[out.request_id].append(out.outputs[0].text)
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
    assert engine.scheduler.stats.num_preemptions > 0
    assert "r5" not in finish
    for i in range(5):
        text, stop = texts[i], stops[i]
        assert finish[f"r{i}"] == "stop"
        assert "".join(pieces[f"r{i}"]) == text[: text.index(stop)]
    _idle(engine)


def test_outputs_of_a_round_arrive_with_the_next_step(model_dir):
    llm = _llm(model_dir)
    engine = llm.engine
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    assert engine.step() == []  # the prefill round ran; its token is collected next step
    outs = engine.step()
    assert [o.request_id for o in outs] == ["one"]
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 1
    _idle(engine)
