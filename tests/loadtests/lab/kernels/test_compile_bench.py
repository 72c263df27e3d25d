"""The benchmark's parallel pre-compilation: stand-in batches specialise the kernel like the
timed ones, tasks cover the grid once, and tile overrides parse strictly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import arch
from loadtests.lab.kernels import attention as bench
from loadtests.lab.kernels import common
from loadtests.lab.kernels.compile import CompileTask, compile_tasks, stand_in_batch


@pytest.mark.parametrize("shape", [(1, 1024, 1, 4), (16, 8192, 16, 8), (64, 2048, 8, 4)])
def test_stand_in_batch_presents_the_kernel_the_timed_arguments(shape):
    cpu = torch.device("cpu")
    pool = common.KvPool(cpu, num_tokens=4 * common.PAGE_SIZE)
    q, cu, seq_lens, block_tables = pool.batch(*shape)
    timed = (q, pool.k_cache, pool.v_cache, cu, seq_lens, block_tables)
    stand_in = stand_in_batch(cpu, *shape)
    for real, fake in zip(timed, stand_in, strict=True):
        # Triton specialises on dtypes, strides and the integer arguments derived from shapes.
        assert fake.dtype == real.dtype and fake.stride() == real.stride()
        assert fake.shape[1:] == real.shape[1:]
    for index in (0, 3, 4, 5):  # q and the length/page tables: same shapes; caches: 1 block
        assert stand_in[index].shape == timed[index].shape
    assert torch.equal(stand_in[3], cu) and torch.equal(stand_in[4], seq_lens)
    assert stand_in[1].shape[0] == 1 and int(stand_in[5].max()) == 0


def test_tasks_cover_grid_and_sweep_once():
    tiles = arch.FAMILY_CONFIGS["hopper"].attention
    shapes = [(1, 1024, 1, 4), (16, 8192, 16, 8), (1, 1024, 1, 4)]
    sweep_shapes = common.SMALL_SHAPES
    sweep = [({}, sweep_shapes), ({"num_stages": 3}, sweep_shapes)]
    tasks = compile_tasks(tiles, shapes, sweep, small=True)
    assert tasks[0] == CompileTask("small")
    attention = [t for t in tasks if t.kind == "attention"]
    assert len(attention) == len(set(attention))
    base = tuple(sorted(dataclasses.asdict(tiles).items()))
    for shape in shapes:
        assert CompileTask("attention", base, shape, True) in attention
    staged = dict(base) | {"num_stages": 3}
    for shape in sweep_shapes:
        assert CompileTask("attention", base, shape) in attention
        assert CompileTask("attention", tuple(sorted(staged.items())), shape) in attention
    # 2 distinct grid shapes x (ours, per-row) + sweep shapes x 2 settings, less the overlap.
    overlap = sum(s in sweep_shapes for s in set(shapes))
    assert len(attention) == 2 * 2 + 2 * len(sweep_shapes) - overlap


def test_sweep_phases_cover_their_classes():
    for phase in common.SWEEP_PHASES:
        pairs = common.sweep_tasks(phase)
        assert len(pairs) == sum(len(candidates) for _, _, candidates in phase)
        for _, shapes, candidates in phase:
            assert candidates[0] == {}  # the entry as it stands is always a candidate
            assert len(set(shapes)) == len(shapes)
    # Changes of the classes of one phase touch disjoint fields, so their winners combine.
    for phase in common.SWEEP_PHASES:
        fields = [{k for c in candidates for k in c} for _, _, candidates in phase]
        for i, a in enumerate(fields):
            for b in fields[i + 1 :]:
                assert not a & b
    names = {f.name for f in dataclasses.fields(arch.AttentionTiles)}
    for phase in common.SWEEP_PHASES:
        for changes, _ in common.sweep_tasks(phase):
            assert set(changes) <= names


def test_winners_are_the_lowest_geometric_mean_per_class():
    def rec(klass, changes, ms):
        return {"class": klass, "changes": changes, "ours_ms": ms}

    results = [
        rec("a", {}, 1.0),
        rec("a", {}, 4.0),  # geometric mean 2.0
        rec("a", {"x": 1}, 0.5),
        rec("a", {"x": 1}, 9.0),  # 2.12: a lower best shape does not win
        rec("a", {"y": 1}, 1.5),
        rec("a", {"y": 1}, 2.5),  # 1.94: the winner
        rec("b", {}, 1.0),
        {"class": "b", "changes": {"z": 1}, "error": "boom"},
        rec("b", {"z": 1}, 0.1),  # failed on one shape: out
    ]
    assert bench.pick_winners(results) == {"a": {"y": 1}, "b": {}}


def test_parse_tiles():
    assert bench.parse_tiles("") == {}
    assert bench.parse_tiles("block_n=128, num_stages=3") == {"block_n": 128, "num_stages": 3}
    with pytest.raises(ValueError, match="unknown tile field"):
        bench.parse_tiles("blockn=64")


def test_tune_table_has_a_line_per_setting():
    recs = []
    for changes, ms in (({}, 0.2), ({"num_stages": 3}, 0.25)):
        recs.append(
            {
                "batch": 16,
                "ctx": 8192,
                "rows": 16,
                "gqa": 8,
                "ours_ms": ms,
                "ours_frac_copy": 0.5,
                "changes": changes,
            }
        )
    recs.append({"batch": 1, "ctx": 32768, "rows": 8, "gqa": 8, "error": "x", "changes": {}})
    table = bench.tune_table(recs)
    lines = table.splitlines()
    assert len(lines) == 4
    assert "b16 8k r16 GQA8" in lines[0] and "b1 32k r8 GQA8" in lines[0]
    assert lines[2].startswith("| (table entry) | 50.0% (200) | error |")
    assert lines[3].startswith("| num_stages=3 | 50.0% (250) | error |")
