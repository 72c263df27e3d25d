"""`hipfire-serve bench` on the CPU: the arithmetic of a run's figures (full-live windows, refill,
route mix), the policy comparison and targets, the synthetic drafter's cost wrapping, and the
whole pipeline on the `--quick` preset (JSON structure, figures recomputed from the steps)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.drafters.base import DraftBatch, DraftRequest
from executor.drafters.synthetic import SyntheticDrafter
from loadtests.lab.gpu.main import QUICK, main
from loadtests.lab.gpu.report import (
    check_targets,
    compare_policies,
    crossover_index,
    spread,
    summarize,
)
from loadtests.lab.gpu.runs import StepRecord, grid_order, summarize_steps

ACCEPTANCE = Path(__file__).resolve().parents[3] / "scheduler" / "profiles" / "acceptance.json"


# -- one run's figures ------------------------------------------------------------------------
def step(route, tokens, wall, rows=None, pred=0.0, meas=0.0, phases=None, accepted=0, per_pos=()):
    """per_pos: (drafted, accepted) per draft position."""
    return StepRecord(
        route=route,
        num_rows=len(route) if rows is None else rows,
        num_tokens=tokens,
        wall_s=wall,
        predicted_s=pred,
        measured_s=meas,
        phase_s=phases or {},
        num_accepted=accepted,
        drafted_per_pos=[d for d, _ in per_pos],
        accepted_per_pos=[a for _, a in per_pos],
    )


def test_full_live_counts_only_rounds_with_every_slot_decoding():
    steps = [
        step("PP", 2, 0.50, rows=40),  # both prompts prefill: not full-live
        step("AA", 2, 0.01, pred=0.010, meas=0.008, phases={"forward": 0.006, "draft": 0.0}),
        step(
            "SA",
            6,
            0.03,
            9,
            0.020,
            0.025,
            {"forward": 0.02, "draft": 0.004},
            accepted=4,
            per_pos=((1, 1), (1, 1), (1, 1), (1, 1), (1, 0), (1, 0), (1, 0)),
        ),
        step("AP", 1, 0.20, rows=21),  # a successor prefills
        step("A", 1, 0.01),  # one request left: not all C slots
        step("", 0, 0.001),  # release-only step: no round
    ]
    s = summarize_steps(steps, concurrency=2, run_s=1.0)
    assert s["full_live_rounds"] == 2
    assert s["full_live_tokens"] == 8
    assert s["full_live_tok_s"] == pytest.approx(8 / 0.04)
    assert s["num_tokens"] == 12 and s["refill_tok_s"] == pytest.approx(12.0)
    assert s["num_rounds"] == 5
    assert s["route_mix"] == pytest.approx({"S": 1 / 9, "A": 5 / 9, "P": 3 / 9})
    assert s["route_mix_full_live"] == pytest.approx({"S": 0.25, "A": 0.75})
    assert s["mean_rows_full_live"] == pytest.approx(5.5)
    assert s["pred_error"] == pytest.approx(np.mean([0.002 / 0.008, 0.005 / 0.025]))
    assert s["host_share_full_live"] == pytest.approx(1 - 0.030 / 0.04)
    assert s["phase_ms_full_live"]["forward"] == pytest.approx(13.0)
    assert s["step_ms_full_live"] == pytest.approx(20.0)
    assert s["mean_accepted_len"] == pytest.approx(5.0)  # one spec request-round, 4 accepted
    # its depth: 7 drafts, 4 of them accepted
    assert s["drafts_per_spec_full_live"] == pytest.approx(7.0)
    assert s["accepted_share_full_live"] == pytest.approx(4 / 7)


def test_a_step_that_only_launches_counts_towards_the_round_it_launched():
    """An AR round launched ahead: the step launching it finishes no round and returns at
    once; the next step finishes it. Its tokens are the round's, its time both steps'."""
    steps = [
        step("SS", 9, 0.020, accepted=7),  # a speculating round
        step("", 0, 0.002),  # launches the first AR round ahead, finishes nothing
        step("AA", 2, 0.003),  # launches the next one, finishes the first
        step("AA", 2, 0.005),
    ]
    s = summarize_steps(steps, concurrency=2, run_s=0.03)
    assert s["full_live_rounds"] == 3 and s["full_live_tokens"] == 13
    assert s["full_live_s"] == pytest.approx(0.030)
    assert s["step_ms_full_live"] == pytest.approx(10.0)


def test_a_run_without_full_live_rounds_has_no_full_live_figure():
    steps = [step("P", 1, 0.1), step("SP", 3, 0.1), step("S", 4, 0.1)]
    s = summarize_steps(steps, concurrency=2, run_s=0.5)
    assert s["full_live_tok_s"] is None and s["full_live_rounds"] == 0
    assert s["refill_tok_s"] == pytest.approx(16.0)
    assert s["route_mix_full_live"] == {"S": 0.0, "A": 0.0}


@settings(max_examples=30, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(st.text("APS", min_size=0, max_size=4), st.integers(0, 9), st.floats(1e-4, 1.0)),
        max_size=30,
    ),
    concurrency=st.integers(1, 4),
)
def test_full_live_figure_is_a_ratio_of_the_selected_steps(rounds, concurrency):
    steps = [step(r, t, w) for r, t, w in rounds]
    s = summarize_steps(steps, concurrency, run_s=sum(w for _, _, w in rounds) + 1.0)
    full, carried = [], 0.0  # a round-less step's wall goes to the next step with a round
    for r, t, w in rounds:
        if r and len(r) == concurrency and "P" not in r:
            full.append((t, w + carried))
        carried = carried + w if not r else 0.0
    assert s["full_live_rounds"] == len(full)
    if full:
        tokens, wall = sum(t for t, _ in full), sum(w for _, w in full)
        assert s["full_live_tok_s"] == pytest.approx(tokens / wall)
    else:
        assert s["full_live_tok_s"] is None
    for m in (s["route_mix"], s["route_mix_full_live"]):
        assert sum(m.values()) == pytest.approx(1.0) or sum(m.values()) == 0.0


# -- comparisons and targets ------------------------------------------------------------------
def test_crossover_is_where_all_ar_overtakes_all_spec():
    assert crossover_index([2.0, 1.5, 1.1, 0.8]) == 2  # 1.1 is nearer to 1 than 0.8
    assert crossover_index([2.0, 1.5, 1.3, 0.95]) == 3
    assert crossover_index([2.0, 1.5, 0.99]) == 2
    assert crossover_index([0.9, 0.5]) == 0
    assert crossover_index([2.0, 1.5]) is None


def fake_row(policy, drafter, cohort, c, full, refill, sim=None):
    return {
        "policy": policy,
        "drafter": drafter,
        "cohort": cohort,
        "concurrency": c,
        "full_live_tok_s": spread([full]),
        "refill_tok_s": spread([refill]),
        "sim_error_full_live": None if sim is None or full is None else sim / full - 1,
        "sim_error_refill": None if sim is None else sim / refill - 1,
    }


def test_adaptive_is_compared_with_the_better_fixed_policy_and_misses_are_listed():
    rows = [
        fake_row("all-ar", "-", "-", 1, 100.0, 90.0),
        fake_row("all-ar", "-", "-", 8, 600.0, 500.0),
        fake_row("all-ar", "-", "-", 64, 3000.0, 2000.0),
        fake_row("all-spec", "d", "code", 1, 300.0, 250.0),
        fake_row("all-spec", "d", "code", 8, 590.0, 480.0),
        fake_row("all-spec", "d", "code", 64, None, 1500.0),  # no full-live round
        fake_row("adaptive", "d", "code", 1, 297.0, 240.0, sim=330.0),
        fake_row("adaptive", "d", "code", 8, 640.0, 520.0, sim=650.0),
        fake_row("adaptive", "d", "code", 64, 3100.0, 1900.0),
    ]
    comps = compare_policies(rows, [("d", "code")], [1, 8, 64])
    assert [p["metric"] for p in comps] == ["full_live_tok_s", "full_live_tok_s", "refill_tok_s"]
    assert [p["vs_best"] for p in comps] == pytest.approx([0.99, 640 / 600, 1900 / 2000])
    assert [p["crossover"] for p in comps] == [False, True, False]
    targets = check_targets(comps, rows, roofline=[], idle={})
    assert targets["adaptive_vs_best"]["status"] == "missed"
    assert [p["concurrency"] for p in targets["adaptive_vs_best"]["misses"]] == [64]
    assert targets["adaptive_at_crossover"]["status"] == "met"  # 640/600 and 640/590 >= 1.05
    assert targets["roofline"]["status"] == "not measured"
    sims = targets["simulator_errors"]
    assert [round(s["error"], 4) for s in sims] == [
        round(330 / 297 - 1, 4),
        round(650 / 640 - 1, 4),
    ]
    assert targets["simulator"]["status"] == "missed"  # 330 vs 297 is 11% off


def test_spread_ignores_missing_repeats():
    assert spread([None, None]) is None
    assert spread([3.0, None, 1.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}


def test_grid_is_repeat_major_and_runs_all_ar_once_per_c():
    order = grid_order(QUICK)
    num_spec = len(QUICK.points()) * len(QUICK.concurrency) * 2  # adaptive, all-spec
    assert len(order) == QUICK.repeats * (len(QUICK.concurrency) + num_spec)
    assert [rep for rep, *_ in order] == sorted(rep for rep, *_ in order)
    ar = [(rep, c) for rep, policy, _, _, c in order if policy == "all-ar"]
    assert len(ar) == len(set(ar)) == QUICK.repeats * len(QUICK.concurrency)


# -- the synthetic drafter paying a real drafter's cost ----------------------------------------
class RecordingDrafter:
    name = "recording"
    has_probs = True

    def __init__(self):
        self.calls: list[tuple] = []

    def setup(self, slot, context):
        self.calls.append(("setup", slot, len(context)))

    def release(self, slot):
        self.calls.append(("release", slot))

    def propose(self, requests, greedy, defer=False):
        self.calls.append(("propose", [(r.slot, r.num_draft) for r in requests]))
        return DraftBatch(tokens=[[7] * r.num_draft for r in requests], catchup_ms=1.5)

    def commit(self, slot, context, num_accepted, num_draft):
        self.calls.append(("commit", slot, num_accepted, num_draft))


def test_synthetic_drafter_runs_its_inner_drafter_and_keeps_its_own_acceptance():
    inner = RecordingDrafter()
    paying = SyntheticDrafter(ACCEPTANCE, "mixed", seed=3, inner=inner)
    free = SyntheticDrafter(ACCEPTANCE, "mixed", seed=3)
    prompt = [5, 6, 7, 8]
    for d in (paying, free):
        d.setup(0, prompt)
    context = [*prompt, 9]
    for depth in (3, 5, 7):
        reqs = [DraftRequest(0, context, depth)]
        got, want = paying.propose(reqs, [True]), free.propose(reqs, [True])
        assert got.forced_accept == want.forced_accept
        assert got.tokens == want.tokens == [[9] * depth]  # placeholders, not the inner's
        assert got.catchup_ms == 1.5 and got.probs is None
        context += [9] * (got.forced_accept[0] + 1)
        paying.commit(0, context, got.forced_accept[0], depth)
    paying.release(0)
    kinds = [c[0] for c in inner.calls]
    assert kinds == ["setup"] + ["propose", "commit"] * 3 + ["release"]
    assert inner.calls[2][2] == paying_accepted_first(free, prompt)
    assert paying.model is None and not paying.has_probs


def paying_accepted_first(drafter, prompt):
    """The first round's accepted count of a fresh trace on the same prompt."""
    fresh = SyntheticDrafter(ACCEPTANCE, "mixed", seed=3)
    fresh.setup(0, prompt)
    return fresh.propose([DraftRequest(0, [*prompt, 9], 3)], [True]).forced_accept[0]


@pytest.mark.parametrize(
    ("cost_drafter", "inner_name"), [("random:tiny", "draft-model"), ("ngram", "ngram")]
)
def test_engine_builds_the_cost_drafter_inside_the_synthetic_one(cost_drafter, inner_name):
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    engine = Engine(
        EngineConfig(
            model="random:tiny",
            draft="synthetic",
            allow_synthetic_draft=True,
            synthetic_cost_drafter=cost_drafter,
            acceptance_profile=f"{ACCEPTANCE}:code",
            max_concurrency=2,
            max_model_len=128,
            kv_cache_memory="8MiB",
            device="cpu",
        )
    )
    assert engine.drafter.name == "synthetic"
    assert engine.drafter.inner.name == inner_name
    assert (engine.drafter.model is not None) == (inner_name == "draft-model")


def test_a_synthetic_cost_drafter_must_be_a_real_one():
    from hipfire_serve.config import EngineConfig

    with pytest.raises(ValueError, match="synthetic-cost-drafter"):
        EngineConfig(synthetic_cost_drafter="synthetic").validate()


# -- the whole pipeline on the quick preset ----------------------------------------------------
@pytest.fixture(scope="module")
def quick_record(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--out", str(out)]) == 0
    return json.loads((out / "gpu.json").read_text()), out


def test_quick_run_writes_every_output(quick_record):
    record, out = quick_record
    names = ("gpu-throughput.png", "gpu-route-mix.png", "gpu-predicted.png", "gpu-roofline.png")
    for name in ("gpu.md", *names):
        assert (out / name).stat().st_size > 0
    md = (out / "gpu.md").read_text()
    assert "## Targets" in md and "## Adaptive against the fixed policies" in md
    assert set(record["targets"]) >= {
        "adaptive_vs_best",
        "adaptive_at_crossover",
        "roofline",
        "gpu_idle_c64",
        "simulator",
    }
    assert record["profile"]["target"]["rows_kv_ms"]
    assert len(record["roofline"]) == len(record["profile"]["target"]["rows_kv_ms"])
    # prompt lookup's speculating rounds priced by its own host time and pace, not the draft
    # model's (which the record's profile holds)
    lookup = record["profile"]["by_drafter"]["ngram"]
    points = [c for c, _ in record["profile"]["target"]["spec_host_ms_per_round"]]
    assert [c for c, _ in lookup["spec_round_ratio"]] == points
    assert [c for c, _ in lookup["spec_host_ms_per_round"]] == points
    assert all(r > 0 for _, r in lookup["spec_round_ratio"])
    assert lookup["drafter_host"]["name"] == "ngram"
    # each drafter's factor on equal contexts beside the profile's (uneven ones)
    for terms in (lookup, record["profile"]["by_drafter"]["random:tiny"]):
        assert [c for c, _ in terms["spec_round_ratio_even"]] == points
    assert record["skipped"] == []
    # runs carry the estimator's knowledge from each C to the next of their line (the default)
    assert record["config"]["cold_estimator"] is False
    lowest = min(record["config"]["concurrency"])
    assert all(r["acceptance_carried"] == (r["concurrency"] > lowest) for r in record["runs"])
    assert "adopted what the previous run" in md and "(cold)" not in md
    # the record names the repo's acceptance models by their path in the repo
    assert record["config"]["acceptance"] == "scheduler/profiles/acceptance.json"


def test_quick_runs_recompute_from_their_steps(quick_record):
    record, _ = quick_record
    cfg = record["config"]
    runs = record["runs"]
    assert len(runs) == len(grid_order(QUICK))
    for run in runs:
        steps = [StepRecord(**s) for s in run["steps"]]
        assert run["num_tokens"] == run["num_requests"] * cfg["max_tokens"]  # ignore_eos
        assert run["num_requests"] == max(cfg["waves"] * run["concurrency"], cfg["min_requests"])
        # a step's tokens are its rounds' (letters of a decode round + its accepted drafts)
        for st_ in steps:
            if st_.route and "P" not in st_.route:
                assert st_.num_tokens == len(st_.route) + st_.num_accepted
            # per draft position: the speculating requests that drafted it, fewer deeper
            # down, and of them those accepted
            drafted, accepted = st_.drafted_per_pos, st_.accepted_per_pos
            assert len(drafted) == len(accepted) and sum(accepted) == st_.num_accepted
            assert all(a <= d for a, d in zip(accepted, drafted))
            assert drafted == sorted(drafted, reverse=True)
            if drafted:
                assert drafted[0] == st_.route.count("S")
        again = summarize_steps(steps, run["concurrency"], run["run_s"])
        keys = (
            "full_live_tok_s",
            "refill_tok_s",
            "full_live_rounds",
            "route_mix",
            "mean_accepted_len",
        )
        for key in keys:
            assert again[key] == pytest.approx(run[key])
        if run["policy"] == "all-ar":
            assert run["route_mix"]["S"] == 0.0
        # compilations recorded per run (none on a CPU: torch reference ops)
        assert run["compiles"]["count"] >= 0 and run["draft_graphs_captured"] >= 0
        if run["policy"] == "all-spec":
            assert run["route_mix"]["S"] > 0.0
    assert sum(r["full_live_tok_s"] is not None for r in runs) > len(runs) // 2


def test_quick_summary_averages_repeats_and_sits_beside_the_simulator(quick_record):
    record, _ = quick_record
    runs = record["runs"]
    for row in record["summary"]:
        key = (row["policy"], row["drafter"], row["cohort"], row["concurrency"])
        mine = [
            r for r in runs if (r["policy"], r["drafter"], r["cohort"], r["concurrency"]) == key
        ]
        assert row["num_repeats"] == len(mine)
        if mine:
            assert row["refill_tok_s"]["mean"] == pytest.approx(
                np.mean([r["refill_tok_s"] for r in mine])
            )
            assert row["sim_error_refill"] == pytest.approx(
                row["sim"]["refill_tok_s"] / row["refill_tok_s"]["mean"] - 1
            )
        assert row["sim"]["refill_tok_s"] > 0
    sim_only = {r["policy"] for r in record["summary"] if r["num_repeats"] == 0}
    assert sim_only == {"clairvoyant"}
    assert len(record["comparisons"]) == len(QUICK.points()) * len(QUICK.concurrency)


def test_a_spent_time_budget_skips_runs_but_still_reports(tmp_path):
    assert main(["--quick", "--out", str(tmp_path), "--time-budget-s", "0.001"]) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["runs"] == [] and len(record["skipped"]) == len(grid_order(QUICK))
    assert record["targets"]["adaptive_vs_best"]["status"] == "not measured"
    assert "Runs not made" in (tmp_path / "gpu.md").read_text()
    assert {s["reason"] for s in record["skipped"]} == {"time budget"}


def test_bad_flags_are_refused():
    assert main(["--quick", "--out", "x", "--policies", "clairvoyant"]) == 2
    assert main(["--quick", "--out", "x", "--drafters", "random:tiny,random:qwen3-0.6b"]) == 2


def test_summarize_keeps_simulator_only_points():
    sims = {("clairvoyant", "d", "code", 4): {"full_live_tok_s": 10.0, "refill_tok_s": 8.0}}
    (row,) = summarize([], sims)
    assert row["num_repeats"] == 0 and row["full_live_tok_s"] is None
    assert row["sim_error_refill"] is None


def test_roofline_rows_pair_each_profiled_round_with_its_ceiling_bound():
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine
    from loadtests.lab.gpu.measure import add_round_phases, roofline_curve

    engine = Engine(
        EngineConfig(
            model="random:tiny",
            draft="ngram",
            max_concurrency=2,
            max_model_len=128,
            kv_cache_memory="8MiB",
            device="cpu",
        )
    )
    ceilings = {"copy_read_plus_write_TBps": 2e-6, "bf16_gemm_TFLOPs": 1e-6}
    profile = {"ceilings": ceilings, "target": {"rows_kv_ms": [[1, 16, 2.0], [16, 48, 5.0]]}}
    curve = roofline_curve(engine, profile)
    # 16 rows on 2 slots are 2 speculative groups of 8 rows, each over 48 tokens of KV
    assert [(r["rows"], r["seqs"]) for r in curve] == [(1, 1), (16, 2)]
    cfg, params = engine.target.config, engine.target.num_params
    elt = engine.target.weights.embed.element_size()
    for r in curve:
        kv_tokens = r["seqs"] * r["kv_len"]
        bytes_ = params * elt + kv_tokens * cfg.kv_bytes_per_token(elt)
        flops = 2 * params * r["rows"] + 4 * kv_tokens * cfg.q_size * cfg.num_layers
        want_ms = max(bytes_ / 2e6, flops / 1e6) * 1e3
        assert r["roofline_ms"] == pytest.approx(want_ms)
        assert r["ratio"] == pytest.approx(r["round_ms"] / want_ms)
    profile["ceilings"] = {}
    assert all(r["roofline_ms"] is None for r in roofline_curve(engine, profile))
    # shapes over 1.3 x their roofline get a phase profile
    curve = [
        {"rows": 4, "kv_len": 16, "ratio": 2.0},  # two speculative groups of 2 rows
        {"rows": 1, "kv_len": 16, "ratio": 1.1},
        {"rows": 1, "kv_len": 16, "ratio": None},
    ]
    assert add_round_phases(engine, QUICK, curve, deadline=0.0) == 0  # no time left
    assert add_round_phases(engine, QUICK, curve, deadline=float("inf")) == 1
    assert set(curve[0]["phases_ms"]) == {"build", "draft", "forward", "accept", "commit"}
    assert curve[0]["phases_ms"]["forward"] > 0
    assert "phases_ms" not in curve[1] and "phases_ms" not in curve[2]


def test_a_run_that_raises_is_recorded_and_the_engine_recovered(tmp_path, monkeypatch):
    from loadtests.lab.gpu import runs as gpu_bench_runs

    original = gpu_bench_runs.drive_refill
    calls = []

    def failing_once(engine, prompts, concurrency, params):
        calls.append(concurrency)
        if len(calls) == 2:  # leave requests in flight, then fail
            for i, prompt in enumerate(prompts[:concurrency]):
                engine.add_request(f"doomed-{i}", prompt, params)
            engine.step()
            raise RuntimeError("injected")
        return original(engine, prompts, concurrency, params)

    monkeypatch.setattr(gpu_bench_runs, "drive_refill", failing_once)
    assert main(["--quick", "--out", str(tmp_path), "--repeats", "1", "--sim-seeds", "1"]) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    (failed,) = record["skipped"]
    assert failed["reason"].startswith("failed: RuntimeError('injected')")
    assert len(record["runs"]) == len(calls) - 1
    for run in record["runs"]:
        assert run["num_tokens"] == run["num_requests"] * record["config"]["max_tokens"]


def test_report_shows_gpu_only_sections_when_they_were_measured(quick_record, tmp_path):
    from loadtests.lab.gpu import plots as gpu_bench_plots
    from loadtests.lab.gpu.report import markdown

    record = dict(quick_record[0])
    record["roofline"] = [
        {"rows": r, "seqs": r, "kv_len": 512, "round_ms": 5.0 + r, "roofline_ms": 4.0 + r,
         "ratio": (5.0 + r) / (4.0 + r)}
        for r in (1, 8, 64)
    ]  # fmt: skip
    record["idle"] = {
        "all-ar": {"wall_ms_per_round": 9.0, "gpu_busy_ms_per_round": 7.02,
                   "gpu_idle_fraction": 0.22}
    }  # fmt: skip
    record["profile"] = {**record["profile"], "ceilings": {
        "copy_read_plus_write_TBps": 4.2, "bf16_gemm_TFLOPs": 780.0}}  # fmt: skip
    md = markdown(record)
    assert "## Round time against the roofline" in md and "| 64 | 64 | 512 |" in md
    assert "| 1.20 | - | - | - | - |" in md  # 6 / 5 ms: within 1.3 x, not re-timed
    assert "| all-ar | 9.000 | 7.020 | 22.0% |" in md
    assert "copy 4.2 TB/s" in md
    gpu_bench_plots.roofline_plot(record, tmp_path / "roof.png")
    assert (tmp_path / "roof.png").stat().st_size > 0


class FakeGraphs:
    """Records captures; block-table widths as the real graphs compute them."""

    max_rows = 1024
    max_blocks_per_seq = 512

    def __init__(self):
        self.graphs = {}

    def width_for(self, num_blocks):
        from executor.graphs import DecodeGraphs

        return DecodeGraphs.width_for(self, num_blocks)

    def capture(self, bucket, width, max_q_len=1):
        self.graphs[(bucket, width, max_q_len)] = None


def test_graph_warm_up_covers_the_shapes_the_runs_replay():
    from types import SimpleNamespace

    from loadtests.lab.gpu.config import BenchConfig
    from loadtests.lab.gpu.runs import warm_graphs

    graphs = FakeGraphs()
    engine = SimpleNamespace(
        executor=SimpleNamespace(graphs=graphs), config=SimpleNamespace(block_size=16)
    )
    assert warm_graphs(engine, BenchConfig()) == len(graphs.graphs) == 84
    # contexts of 512 .. 1672 tokens: 32 .. 105 blocks, widths 64 and 128
    assert {w for _, w, _ in graphs.graphs} == {64, 128}
    # all-AR rounds of up to 128 rows; full-depth rounds of 128 requests x 8 rows
    assert max(b for b, _, q in graphs.graphs if q == 1) == 128
    assert max(b for b, _, q in graphs.graphs if q == 8) == 1024
    assert all(b >= q for b, _, q in graphs.graphs)
    no_graphs = SimpleNamespace(executor=SimpleNamespace(graphs=None))
    assert warm_graphs(no_graphs, BenchConfig()) == 0


def test_the_simulator_baselines_also_run_on_the_engine(tmp_path):
    policies = "adaptive,all-ar,all-spec,threshold,goodput,sticky,survival"
    argv = ["--quick", "--out", str(tmp_path), "--repeats", "1", "--drafters", "ngram"]
    assert main([*argv, "--policies", policies, "--concurrency", "2"]) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert sorted(r["policy"] for r in record["runs"]) == sorted(policies.split(","))
    for run in record["runs"]:
        assert run["num_failed"] == 0
        assert run["num_tokens"] == run["num_requests"] * record["config"]["max_tokens"]


def test_stall_rows_name_the_runs_and_what_they_compiled():
    from loadtests.lab.gpu.report import stall_rows

    base = {"policy": "adaptive", "drafter": "ngram", "cohort": "mixed", "concurrency": 16}
    compiled = {"count": 2, "seconds": 1.25, "kernels": ["_k1", "_k2"]}
    stalled = [[12.0, 12.5, True], [12.7, 1309.1, True]]
    runs = [
        {**base, "pred_vs_meas": stalled, "draft_graphs_captured": 0, "compiles": compiled},
        {**base, "concurrency": 8, "pred_vs_meas": [[70.0, 120.0, False]], "compiles": None},
        {**base, "concurrency": 4, "pred_vs_meas": [[5.0, 90.0, True]]},  # under 100 ms
    ]
    rows = stall_rows(runs)
    assert rows == [
        ["adaptive", "ngram", "mixed", "16", "1309", "2 (1.25 s): _k1, _k2", "0"],
    ]


def test_the_draft_model_can_follow_prefills_in_the_runs(tmp_path):
    argv = ["--quick", "--out", str(tmp_path), "--repeats", "1", "--concurrency", "2"]
    argv += ["--drafters", "random:tiny", "--policies", "adaptive,all-spec"]
    assert main([*argv, "--drafter-follows-prefill", "auto"]) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["config"]["drafter_follows_prefill"] == "auto"
    assert sorted(r["policy"] for r in record["runs"]) == ["adaptive", "all-spec"]
    for run in record["runs"]:
        assert run["num_failed"] == 0
        assert run["num_tokens"] == run["num_requests"] * record["config"]["max_tokens"]


def test_a_record_is_re_derived_from_its_steps(quick_record, tmp_path):
    """gpu_bench_rederive recomputes every run's figures, the comparisons and the targets
    from the steps: from a record written now it gets the record's own figures back."""
    import copy

    from loadtests.lab.gpu.rederive import main as rederive_main
    from loadtests.lab.gpu.rederive import rederive

    record, _ = quick_record
    spoiled = copy.deepcopy(record)
    for run in spoiled["runs"]:
        run["full_live_tok_s"], run["full_live_rounds"] = -1.0, -1
    again = rederive(spoiled)
    for old, new in zip(record["runs"], again["runs"]):
        for key in ("full_live_tok_s", "full_live_rounds", "refill_tok_s", "route_mix"):
            assert new[key] == pytest.approx(old[key])
    assert [c["vs_best"] for c in again["comparisons"]] == pytest.approx(
        [c["vs_best"] for c in record["comparisons"]]
    )
    assert again["notes"] == record["notes"] and again["step_tokens"] == "round"
    # a record without steps is refused with a one-line message
    path = tmp_path / "bare.json"
    bare = copy.deepcopy(record)
    bare["runs"][0].pop("steps")
    path.write_text(json.dumps(bare))
    assert rederive_main([str(path), "--out", str(tmp_path / "out")]) == 2


def test_an_older_record_gets_its_rounds_tokens_back(quick_record):
    """Records written before `step_tokens` counted per step the outputs the step returned
    (one step late behind rounds launched ahead, in round-less steps at a switch to AR):
    re-derived, a decode round's tokens are its requests plus its accepted drafts, and the
    full-live figures are those of a record written now."""
    import copy

    from loadtests.lab.gpu.rederive import rederive

    record, _ = quick_record
    older = copy.deepcopy(record)
    older.pop("step_tokens")
    for run in older["runs"]:
        steps = run["steps"]
        tokens = [s["num_tokens"] for s in steps]
        for s, t in zip(steps, [0, *tokens[:-1]]):  # every step one round late
            s["num_tokens"] = t
    again = rederive(older)
    for old, new in zip(record["runs"], again["runs"]):
        assert new["full_live_tok_s"] == pytest.approx(old["full_live_tok_s"])
        assert new["refill_tok_s"] == pytest.approx(old["refill_tok_s"])
    assert "re-derived" in again["notes"][-1]


def test_records_of_one_workload_are_pooled(quick_record, tmp_path):
    """Two records of the same workload pool into one: every run of both, the second's repeats
    numbered after the first's, figures over all of them (two copies of one record: the same
    means, twice the repeats); records of different workloads are refused with one line."""
    import copy

    from loadtests.lab.gpu import report
    from loadtests.lab.gpu.rederive import main as rederive_main
    from loadtests.lab.gpu.rederive import pool

    record, _ = quick_record
    pooled = pool([copy.deepcopy(record), copy.deepcopy(record)])
    first_repeats = {r["repeat"] for r in record["runs"]}
    assert len(pooled["runs"]) == 2 * len(record["runs"])
    shift = max(first_repeats) + 1
    assert {r["repeat"] for r in pooled["runs"]} == first_repeats | {
        r + shift for r in first_repeats
    }
    assert pooled["config"]["repeats"] == 2 * shift
    for old, new in zip(record["summary"], pooled["summary"]):
        assert new["num_repeats"] == 2 * old["num_repeats"]
        if old["full_live_tok_s"]:
            assert new["full_live_tok_s"]["mean"] == pytest.approx(old["full_live_tok_s"]["mean"])
        assert new["sim"] == old["sim"]
    assert [c["vs_best"] for c in pooled["comparisons"]] == pytest.approx(
        [c["vs_best"] for c in record["comparisons"]]
    )
    assert "pooled from" in pooled["notes"][-1]
    # each record's own ratios beside the pooled ones (a spoiled copy differs from the first)
    spoiled = copy.deepcopy(record)
    for c in spoiled["comparisons"]:
        c["vs_best"] = 0.5
    two = pool([copy.deepcopy(record), spoiled])
    assert [p["vs_best"] for p in two["pooled_records"]] == [
        [[c["drafter"], c["cohort"], c["concurrency"], c["vs_best"]] for c in r["comparisons"]]
        for r in (record, spoiled)
    ]
    text = report.markdown(two)
    assert "### Adaptive / better fixed policy in each pooled record" in text
    c = record["comparisons"][0]
    row = f"| {c['drafter']} | {c['cohort']} | {c['concurrency']} |"
    section = text.split("### Adaptive / better fixed policy in each pooled record")[1]
    line = next(x for x in section.splitlines() if x.startswith(row))
    low = 1 + (c["vs_best"] < 0.98)
    assert f"| {c['vs_best']:.3f} | 0.500 |" in line and f"| {low} of 2 |" in line
    assert "### Adaptive / better fixed policy" not in report.markdown(record)
    # the command line: two records in, one pooled record out; another workload refused
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(record))
    b.write_text(json.dumps(record))
    assert rederive_main([str(a), str(b), "--out", str(tmp_path / "pooled")]) == 0
    written = json.loads((tmp_path / "pooled" / "gpu.json").read_text())
    assert len(written["runs"]) == 2 * len(record["runs"])
    other = copy.deepcopy(record)
    other["config"]["max_tokens"] += 1
    b.write_text(json.dumps(other))
    assert rederive_main([str(a), str(b), "--out", str(tmp_path / "no")]) == 2
    with pytest.raises(ValueError, match="max_tokens"):
        pool([record, other])
    # cold and carried records do not pool; a record without the key was made cold
    cold, older = copy.deepcopy(record), copy.deepcopy(record)
    cold["config"]["cold_estimator"] = True
    del older["config"]["cold_estimator"]
    with pytest.raises(ValueError, match="cold_estimator"):
        pool([record, cold])
    with pytest.raises(ValueError, match="cold_estimator"):
        pool([record, older])
    assert len(pool([cold, older])["runs"]) == 2 * len(record["runs"])
    assert "(cold)" in report.markdown(older)


def test_each_finished_run_leaves_the_collectors_generations(monkeypatch):
    """The grid freezes the heap after every run, so the growing step records of finished runs
    are not scanned by full collections inside later runs' measured rounds."""
    import gc
    from types import SimpleNamespace

    from loadtests.lab.gpu import runs as gpu_bench_runs

    def fake_run(engine, cfg, policy, drafter, cohort, c, paths, model_inner, compiles, known):
        return {"full_live_tok_s": 1.0, "refill_tok_s": 1.0, "run_s": 0.0, "num_failed": 0,
                "records": [{"step": i} for i in range(100)]}  # fmt: skip

    monkeypatch.setattr(gpu_bench_runs, "run_point", fake_run)
    frozen = []
    engine = SimpleNamespace(
        freeze_heap=lambda: frozen.append(gc.freeze()),
        scheduler=SimpleNamespace(acceptance_knowledge=lambda: None),
    )
    try:
        runs, skipped = gpu_bench_runs.run_grid(
            engine, QUICK, {}, None, float("inf"), lambda msg: None
        )
        assert runs and not skipped and len(frozen) == len(runs)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(r["records"][0]) in tracked for r in runs)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("cold", [False, True])
def test_a_run_starts_from_what_the_last_run_of_its_line_learned(monkeypatch, cold):
    """run_grid hands each run the estimator knowledge that the previous finished run of its
    (repeat, policy, drafter, cohort) left in the engine's scheduler (the next lower C in grid
    order); the first C of a line, a failed run's successor's source and --cold-estimator get
    the configured prior. The simulator's chains do the same with its runs."""
    import dataclasses
    from types import SimpleNamespace

    from loadtests.lab.gpu import measure as gpu_bench_measure
    from loadtests.lab.gpu import runs as gpu_bench_runs

    cfg = dataclasses.replace(QUICK, repeats=2, cold_estimator=cold)
    engine = SimpleNamespace(freeze_heap=lambda: None, scheduler=None)
    handed = []

    def fake_run(engine_, cfg_, policy, drafter, cohort, c, paths, model_inner, compiles, known):
        handed.append(((policy, drafter, cohort), c, known))
        if (policy, c) == ("all-spec", 2):
            raise RuntimeError("injected")
        line = (policy, drafter, cohort, len(handed))
        engine.scheduler = SimpleNamespace(acceptance_knowledge=lambda: line)
        return {"full_live_tok_s": 1.0, "refill_tok_s": 1.0, "run_s": 0.0, "num_failed": 0}

    monkeypatch.setattr(gpu_bench_runs, "run_point", fake_run)
    monkeypatch.setattr(gpu_bench_runs, "recover", lambda engine: True)
    _runs, skipped = gpu_bench_runs.run_grid(engine, cfg, {}, None, float("inf"), lambda m: None)
    assert len(handed) == len(grid_order(cfg)) and len(skipped) == 2 * len(cfg.points())
    last = {}  # (repeat, policy, drafter, cohort) -> the knowledge its last finished run left
    for i, ((rep, policy, drafter, cohort, c), (_, _, known)) in enumerate(
        zip(grid_order(cfg), handed)
    ):
        line = (rep, policy, drafter, cohort)
        assert known == (None if cold else last.get(line)), (line, c)
        if not (policy == "all-spec" and c == 2):
            last[line] = (policy, drafter, cohort, i + 1)
    carried = sum(known is not None for *_, known in handed)
    assert carried == (0 if cold else len(handed) - len(last))  # all but each line's first C

    # the simulator's chains: each task gets the knowledge the previous task of its chain ended
    # with, unless cold
    got = []

    def fake_task(task, known=None):
        got.append((task, known))
        return {"acceptance": ("after", task)}

    monkeypatch.setattr(gpu_bench_measure, "_sim_task", fake_task)
    out = gpu_bench_measure._sim_chain((("a", "b", "c"), not cold))
    assert [a for _, a in got] == ([None] * 3 if cold else [None, ("after", "a"), ("after", "b")])
    assert out == [{"acceptance": ("after", t)} for t in "abc"]
