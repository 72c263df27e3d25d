"""Device kernels by phase: a regex table over kernel names (the first rule that matches wins,
a name no rule matches is "other"), the profiler's device events of a window reduced to a
per-name table and the busy time (the union of their intervals), and the per-step phase
figures derived from that table. The table is kept in the record, so a record can be
re-classified when a rule changes (`--merge`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

PHASES = ("gemm", "attention", "norm", "rope", "activation", "sampling", "copy", "other")

# (phase, regex searched in the kernel's name). Order matters: this project's kernels by exact
# name first (the fused q/k kernel does head norm, RoPE and the paged KV store, and counts as
# rope; the skinny linear layer's split reduction is gemm, the attention's split merge is
# attention); sampling libraries before attention ("flashinfer::sampling"); attention before
# gemm (FlashAttention 3 is `cutlass::device_kernel<flash::...>`); gemm before activation (a
# cuBLAS kernel with a fused relu is a gemm); rope before norm (vLLM's fused q/k norm + RoPE is
# rope, like ours); inductor's fused kernels are named after their aten ops, alphabetically.
RULES: tuple[tuple[str, str], ...] = (
    ("attention", r"^_(verify_attention|merge_splits|delta_rows|replay)_kernel$"),
    ("rope", r"^_(qk_norm_rope_kv|rope_and_write_kv)_kernel$"),
    # the quantized layers' split-K reduction and FP8 activation quantization belong to them
    ("gemm", r"^_(skinny_linear|reduce_splits|int4_skinny|int4_tiled|fp8_skinny)_kernel$"),
    ("gemm", r"^_(reduce|quantize_rows)_kernel$"),
    ("norm", r"^_(head_)?rms_norm_kernel$"),
    ("activation", r"^_silu_and_mul_kernel$"),
    ("sampling", r"^_((chunk|merge)_top_k(_sorted)?|accept_(greedy|rejection))_kernel$"),
    ("sampling", r"sampling::|Sampling|sampler"),
    (
        "attention",
        r"flash::|flash_fwd|flash_attn|FlashAttn|fmha|paged_?attention|PagedKV|BatchDecode"
        r"|BatchPrefill|SinglePrefill|SingleDecode|unified_attention|reduce_segments"
        r"|reshape_and_cache|concat_and_cache|merge_attn_states|attention_kernel|attn_fwd",
    ),
    ("copy", r"^Memcpy|^Memset"),
    (
        "gemm",
        r"gemm|gemv|nvjet|cutlass|cublas|xmma|splitKreduce|wgmma|matmul|_mm_kernel"
        r"|^triton_tem_|(^|_)(addmm|bmm|mm)(_|$)",
    ),
    ("rope", r"rotary|rope|pos_encoding|^triton_\w*fused_\w*cat_\w*mul_\w*(neg|sub)"),
    ("norm", r"rms_?norm|RMSNorm|layer_?norm|LayerNorm|rsqrt"),
    ("activation", r"silu|gelu|swiglu|act_and_mul|relu"),
    (
        "sampling",
        r"argmax|ArgMax|arg_max|top_?k|TopK|softmax|SoftMax|[sS]ort|gumbel|multinomial"
        r"|exponential|logsumexp|LogSoftMax|penalt",
    ),
    (
        "copy",
        r"copy|Copy|[fF]ill|index_?[sS]elect|indexSelect|gather|scatter|embedding|Embedding"
        r"|CatArray",
    ),
)
_COMPILED = tuple((phase, re.compile(rx)) for phase, rx in RULES)


@lru_cache(maxsize=4096)
def classify(name: str) -> str:
    for phase, rx in _COMPILED:
        if rx.search(name):
            return phase
    return "other"


class KernelEvent(NamedTuple):
    """One device activity (kernel, copy or memset): its name and interval in microseconds."""

    name: str
    start_us: float
    end_us: float


# Device-side records that are waits, not work (CUPTI's synchronisation records, where a
# profiler build records them): left out, or the busy time would cover the waits.
_WAITS = re.compile(r"^(Event|Stream|Context|Device) (Sync|Synchronize|Wait)")


def device_events(prof) -> list[KernelEvent]:
    """The device activities of a finished `torch.profiler.profile`, kernels of replayed CUDA
    graphs included (CUPTI records each kernel of a graph launch)."""
    from torch.autograd import DeviceType

    device = {DeviceType.CUDA, getattr(DeviceType, "HIP", DeviceType.CUDA)}
    return [
        KernelEvent(e.name, float(e.time_range.start), float(e.time_range.end))
        for e in prof.events()
        if e.device_type in device and not _WAITS.match(e.name)
    ]


def busy_us(events: Iterable[KernelEvent]) -> float:
    """Union of the events' intervals: kernels that overlap (programmatic dependent launch,
    several streams) count once."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((ev.start_us, ev.end_us) for ev in events):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def kernel_table(events: Iterable[KernelEvent]) -> list[dict]:
    """Per kernel name: launches and summed device time (us), the longest total first."""
    table: dict[str, list[float]] = {}
    for ev in events:
        row = table.setdefault(ev.name, [0, 0.0])
        row[0] += 1
        row[1] += ev.end_us - ev.start_us
    rows = [{"name": n, "count": c, "total_us": t} for n, (c, t) in table.items()]
    return sorted(rows, key=lambda r: (-r["total_us"], r["name"]))


def summarize(events: list[KernelEvent], num_steps: float) -> dict:
    """The raw figures of a profiled window of `num_steps` decode steps; None figures when the
    window holds no device activity (a CPU run)."""
    if not events:
        return {"device_events": False, "busy_ms": None, "kernels": [], "num_kernels": None}
    return {
        "device_events": True,
        "busy_ms": busy_us(events) / num_steps / 1e3,
        "kernels": kernel_table(events),
        "num_kernels": len(events) / num_steps,
    }


def derive(point: dict, top: int = 10) -> dict:
    """Per-step phase figures of a point from its raw ones (`summarize`'s and the wall time):
    phase ms (summed kernel time, so overlapping kernels both count), busy ms (their union),
    overlap = kernel ms - busy, host gap = unprofiled wall - busy, the `top` kernels and every
    kernel no rule matched."""
    steps = point["steps"]
    if not point.get("device_events"):
        empty = dict.fromkeys(("phases_ms", "kernel_ms", "overlap_ms", "host_gap_ms"))
        return {**empty, "top": [], "other": []}
    phases = dict.fromkeys(PHASES, 0.0)
    rows = []
    for k in point["kernels"]:
        phase = classify(k["name"])
        ms = k["total_us"] / steps / 1e3
        phases[phase] += ms
        rows.append({"name": k["name"], "phase": phase, "ms": ms, "count": k["count"] / steps})
    kernel_ms = sum(phases.values())
    for r in rows:
        r["share"] = r["ms"] / kernel_ms if kernel_ms else 0.0
    busy = point["busy_ms"]
    return {
        "phases_ms": phases,
        "kernel_ms": kernel_ms,
        "overlap_ms": kernel_ms - busy,
        "host_gap_ms": point["wall_ms"] - busy if point.get("wall_ms") is not None else None,
        "top": rows[:top],
        "other": [r for r in rows if r["phase"] == "other"],
    }
