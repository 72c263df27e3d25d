"""The PDL variants of the decode forward's kernels, built for sm_90 without a GPU
(`tests/kernels/sm90.py`): each waits for the kernels before it (`gdc_wait`) before it reads
anything but its immutable weights and before any store or atomic, and lets the next kernel
launch (`gdc_launch_dependents`); without USE_PDL neither instruction is there.

The order is checked on Triton's IR, where every load's pointer can be traced back to the kernel
argument it starts from, and again on the PTX. Run as `python -m tests.kernels.test_pdl_sm90`
without TRITON_INTERPRET (it prints one line per kernel variant and exits 1 on a failure); the
test below does that in a fresh interpreter.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels.sm90 import bf16_arg_types, triton_backends

REPO_ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"%[\w.$]+")
_MEMORY_WRITES = ("tt.store", "tt.atomic_rmw", "tt.atomic_cas", "tt.descriptor_store")
_PTX_WRITES = re.compile(r"^\s*(@%p\d+\s+)?(st\.global|atom\.|red\.)")
_PTX_READS = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|cp\.async)")


def _ttir_args(ttir: str) -> tuple[set[str], set[str]]:
    """(pointer arguments, other arguments) of the kernel's function in Triton IR."""
    header = next(line for line in ttir.splitlines() if "tt.func public" in line)
    pointers, others = set(), set()
    for name, kind in re.findall(r"(%[\w.$]+): ([^ ]+)", header):
        (pointers if kind.startswith("!tt.ptr") else others).add(name)
    return pointers, others


def _is_wait(line: str) -> bool:
    # Triton 3.9 has an op for it; 3.6 (the GPU machines') emits the instruction as inline asm
    return "tt.grid_dependency_wait" in line or (
        "tt.elementwise_inline_asm" in line and "griddepcontrol.wait" in line
    )


def check_pre_wait_ttir(ttir: str, weights: set[str]) -> list[str]:
    """What the IR does before `tt.grid_dependency_wait` that it may not: any store or atomic,
    and any load or inline assembly whose operands derive from a pointer argument outside
    `weights` (names as `%w_ptr`). Also a wait that is missing, repeated or not at the top
    level of the function (every program must pass it, so the grid ends after the one
    before). Returns the violations, empty when none."""
    lines = ttir.splitlines()
    waits = [i for i, line in enumerate(lines) if _is_wait(line)]
    if len(waits) != 1:
        return [f"{len(waits)} grid dependency waits"]
    wait = waits[0]
    problems = []
    if lines[wait].startswith("     "):  # the function body's own lines are indented by 4
        problems.append("the wait is nested in control flow")
    pointers, _ = _ttir_args(ttir)
    defs: dict[str, list[str]] = {}
    roots_of: dict[str, set[str]] = {}

    def roots(name: str) -> set[str]:
        if name in pointers:
            return {name}
        if name not in roots_of:
            roots_of[name] = set()  # cycles (loop-carried values) end here
            roots_of[name] = set().union(*(roots(op) for op in defs.get(name, [])))
        return roots_of[name]

    for line in lines[:wait]:
        code = line.split(" loc(")[0]
        if "=" in code and code.strip().startswith("%"):
            results, rhs = code.split("=", 1)
            operands = _NAME.findall(rhs)
            for result in _NAME.findall(results):
                defs[result.split(":")[0]] = operands
        else:
            operands = _NAME.findall(code)
        op = code.split("=", 1)[-1].strip()
        if op.startswith(_MEMORY_WRITES):
            problems.append(f"write before the wait: {op[:80]}")
        if op.startswith(("tt.load", "tt.elementwise_inline_asm", "tt.descriptor_load")):
            touched = set().union(*(roots(o) for o in operands)) - weights
            if touched:
                problems.append(f"reads {sorted(touched)} before the wait: {op[:80]}")
    return problems


def check_ptx(ptx: str, weight_loads_allowed: bool) -> list[str]:
    """The same order on the PTX: no global store or atomic before `griddepcontrol.wait`, no
    global load either unless the kernel reads weights first; dependents launched somewhere."""
    lines = ptx.splitlines()
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    if len(waits) != 1:
        return [f"{len(waits)} griddepcontrol.wait in the PTX"]
    before = lines[: waits[0]]
    problems = [f"PTX writes before the wait: {x.strip()}" for x in before if _PTX_WRITES.match(x)]
    if not weight_loads_allowed:
        problems += [f"PTX reads before the wait: {x.strip()}" for x in before
                     if _PTX_READS.match(x)]  # fmt: skip
    if not any("griddepcontrol.launch_dependents" in line for line in lines):
        problems.append("no griddepcontrol.launch_dependents")
    return problems


def variants():
    """(name, kernel, constexprs, argument types, options, weight arguments read before the
    wait): every kernel of the decode forward in the forms the Qwen3 shapes launch."""
    from kernels import arch
    from kernels.attention import (
        _merge_splits_kernel,
        _verify_attention_kernel,
        plan_launch,
        seqs_pad,
        splits_pad,
    )
    from kernels.fused_qk import _qk_norm_rope_kv_kernel
    from kernels.norms import _rms_norm_kernel, _silu_and_mul_kernel
    from kernels.skinny_linear import TUNED, _reduce_splits_kernel, _skinny_linear_kernel

    for residual in (False, True):
        yield (f"rms_norm residual={residual}", _rms_norm_kernel,
               dict(HAS_RESIDUAL=residual, BLOCK=4096), bf16_arg_types(), {"num_warps": 8},
               {"%w_ptr"})  # fmt: skip
    yield ("silu_and_mul", _silu_and_mul_kernel, dict(BLOCK=4096), bf16_arg_types(),
           {"num_warps": 8}, set())  # fmt: skip
    yield ("qk_norm_rope_kv", _qk_norm_rope_kv_kernel,
           dict(PAGE_SIZE=16, HEAD_DIM=128, D_PAD=128, HALF=64, HALF_PAD=64, PASS_PAD=1,
                HEADS=8, IS_NEOX=True, QK_NORM=True),
           bf16_arg_types(fp32_ptrs=("cos_sin_ptr",)), {"num_warps": 8}, set())  # fmt: skip
    attn_types = bf16_arg_types(
        fp32_ptrs=("part_out_ptr", "part_lse_ptr"),
        int_ptrs=("cu_q_lens_ptr", "seq_lens_ptr", "block_tables_ptr"),
    )
    hopper = arch.FAMILY_CONFIGS["hopper"]
    arch._config_for = lambda device_type, index: (hopper, 132)  # plan as on an H200
    # split launches of 64- and 128-vector tiles, an unsplit launch of 128-vector tiles
    for batch, rows in ((1, 1), (16, 16), (64, 16)):
        launch = plan_launch(
            torch.device("cpu"), num_rows=batch * rows, num_seqs=batch, num_q_heads=32,
            num_kv_heads=8, max_kv_len=1024, max_q_len=rows,
        )  # fmt: skip
        consts = dict(
            GROUP=4, GROUP_PAD=4, ROWS_TILE=launch.rows_per_tile, BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n, HEAD_DIM=128, D_PAD=128, PAGE_SIZE=16,
            SPLIT=launch.num_splits > 1, SEQS_PAD=seqs_pad(batch), EVEN_D=True,
            DOT_PRECISION="tf32", LAZY_RESCALE=False, PIPELINE_QK=False,
        )  # fmt: skip
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        if launch.max_regs:
            options["maxnreg"] = launch.max_regs
        yield (f"verify_attention batch={batch} splits={launch.num_splits}",
               _verify_attention_kernel, consts, attn_types, options, set())  # fmt: skip
    yield ("merge_splits", _merge_splits_kernel,
           dict(HEAD_DIM=128, D_PAD=128, SPLITS_PAD=splits_pad(8)), attn_types,
           {"num_warps": 4}, set())  # fmt: skip
    skinny_types = bf16_arg_types(fp32_ptrs=("part_ptr",), int_ptrs=("counter_ptr",))
    # one split launch reduced by its last split, one by the second kernel, one unsplit, one
    # fp32 multiply-add launch
    for n, k, rows in ((1024, 3072, 1), (1024, 2048, 1), (6144, 4096, 1)):
        cfg = TUNED[(n, k, rows)]
        split = cfg.split_k > 1
        consts = dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      WRITE_PARTIAL=split, LAST_REDUCES=split and cfg.last_reduces,
                      HAS_BIAS=False, EVEN_N=True, EVEN_K=True,
                      PREFETCH_TILES=cfg.num_stages)  # fmt: skip
        yield (f"skinny_linear {cfg.name}", _skinny_linear_kernel, consts, skinny_types,
               {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, {"%w_ptr"})  # fmt: skip
    yield ("skinny_linear fma_n32_k256_s4", _skinny_linear_kernel,
           dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, USE_DOT=False, WRITE_PARTIAL=True,
                LAST_REDUCES=True, HAS_BIAS=True, EVEN_N=False, EVEN_K=False, PREFETCH_TILES=2),
           skinny_types, {"num_warps": 4, "num_stages": 2}, {"%w_ptr"})  # fmt: skip
    yield ("reduce_splits", _reduce_splits_kernel, dict(SPLIT_K=4, BLOCK=1024, HAS_BIAS=True),
           skinny_types, {"num_warps": 4}, set())  # fmt: skip


@triton.jit
def _reads_before_its_wait(x_ptr, w_ptr, out_ptr, USE_PDL: tl.constexpr = False):
    """A kernel that reads x before its wait: the checks must reject it."""
    offs = tl.arange(0, 128)
    w = tl.load(w_ptr + offs)
    x = tl.load(x_ptr + offs)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + offs, x + w)


def main() -> int:
    from tests.kernels.sm90 import compile_sm90

    bad = compile_sm90(_reads_before_its_wait, {"USE_PDL": True}, bf16_arg_types(),
                       {"launch_pdl": True}, "negative control")  # fmt: skip
    if bad is None:
        return 1
    found = check_pre_wait_ttir(bad.asm["ttir"], {"%w_ptr"})
    if not (len(found) == 1 and "%x_ptr" in found[0]):
        print(f"FAIL negative control: the IR check found {found}")
        return 1
    if not check_ptx(bad.asm["ptx"], weight_loads_allowed=False):
        print("FAIL negative control: the PTX check found nothing")
        return 1
    print("ok negative control rejected")
    failed = False
    checked_off = set()
    for name, fn, consts, arg_type, options, weights in variants():
        on = compile_sm90(fn, {**consts, "USE_PDL": True}, arg_type,
                          {**options, "launch_pdl": True}, name)  # fmt: skip
        if on is None:
            return 1
        problems = []
        if fn not in checked_off:  # one variant per kernel without USE_PDL
            checked_off.add(fn)
            off = compile_sm90(fn, {**consts, "USE_PDL": False}, arg_type, options, name)
            if off is None:
                return 1
            text = off.asm["ptx"] + off.asm["ttir"]
            if "griddepcontrol" in text or "grid_dependency" in text:
                problems.append("grid dependency control without USE_PDL")
            if off.metadata.launch_pdl:
                problems.append("launch_pdl without USE_PDL")
        problems += check_pre_wait_ttir(on.asm["ttir"], weights)
        problems += check_ptx(on.asm["ptx"], weight_loads_allowed=bool(weights))
        if not on.metadata.launch_pdl:
            problems.append("compiled without launch_pdl")
        for problem in problems:
            print(f"FAIL {name}: {problem}")
        failed |= bool(problems)
        if not problems:
            print(f"ok {name}")
    return 1 if failed else 0


_IR_HEAD = "  tt.func public @k(%x_ptr: !tt.ptr<bf16>, %w_ptr: !tt.ptr<bf16>, %n: i32) {"


def _ir(*body: str) -> str:
    return "\n".join(["module {", _IR_HEAD, *("    " + line for line in body), "  }", "}"])


def test_the_ir_check_rejects_writes_reads_and_misplaced_waits():
    load_w = ["%a = tt.splat %w_ptr : x", "%b = tt.addptr %a, %n : y", "%c = tt.load %b : y"]
    assert check_pre_wait_ttir(_ir(*load_w, "tt.grid_dependency_wait"), {"%w_ptr"}) == []
    assert check_pre_wait_ttir(_ir(*load_w, "tt.grid_dependency_wait"), set())
    load_x = ["%d = tt.addptr %x_ptr, %n : y", "%e = tt.load %d : y"]
    assert check_pre_wait_ttir(_ir(*load_x, "tt.grid_dependency_wait"), {"%w_ptr"})
    store = ["tt.store %b, %c : y"]
    assert check_pre_wait_ttir(_ir(*load_w, *store, "tt.grid_dependency_wait"), {"%w_ptr"})
    assert check_pre_wait_ttir(_ir(*load_w), {"%w_ptr"}) == ["0 grid dependency waits"]
    nested = ["scf.if %n {", "  tt.grid_dependency_wait", "}"]
    assert check_pre_wait_ttir(_ir(*nested), set()) == ["the wait is nested in control flow"]
    # Triton 3.6 writes the wait as inline assembly
    asm_wait = '%f = tt.elementwise_inline_asm "griddepcontrol.wait; // $0" -> i32'
    assert check_pre_wait_ttir(_ir(*load_w, asm_wait), {"%w_ptr"}) == []
    assert check_pre_wait_ttir(_ir(*load_x, asm_wait), {"%w_ptr"})


def test_the_ptx_check_rejects_global_accesses_before_the_wait():
    wait, launch = "\tgriddepcontrol.wait ;", "\tgriddepcontrol.launch_dependents ;"
    load, store = "\t@%p1 ld.global.b16 { %rs1 }, [ %rd1 + 0 ];", "\tst.global.b16 [ %rd2 ], %rs1;"
    assert check_ptx("\n".join([wait, load, launch, store]), False) == []
    assert check_ptx("\n".join([load, wait, launch]), True) == []
    assert check_ptx("\n".join([load, wait, launch]), False)
    assert check_ptx("\n".join([store, wait, launch]), True)
    assert check_ptx("\n".join([wait, load]), False) == ["no griddepcontrol.launch_dependents"]


@pytest.mark.skipif("nvidia" not in triton_backends(), reason="Triton without its NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_pdl_kernels_wait_before_touching_earlier_kernels_data():
    from tests.kernels.sm90 import run_compile_check

    assert run_compile_check("tests.kernels.test_pdl_sm90").count("ok ") == 14


if __name__ == "__main__":
    sys.exit(main())
