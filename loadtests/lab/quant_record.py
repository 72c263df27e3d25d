"""What one `hipfire-bench quant` call runs (`QuantConfig`, the CPU preset `QUICK`) and its record
from the children's results: each format's roofline, greedy agreement with bf16, the ratios to
bf16 per C beside the targets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loadtests.lab.peer.config import PeerConfig
from loadtests.lab.peer.shape import DTYPE_BYTES, matmul_params, num_params
from loadtests.lab.peer.workloads import wave_lens

FORMATS = ("bf16", "fp8", "w4a16")
BASELINE = "bf16"
REPORT_RESERVE_S = 10.0  # of the time budget, kept for the report and the plot
# Hopper's dense FP8 tensor-core rate over its bf16 rate (the data sheet's): the FP8 roofline's
# GEMM term; attention stays bf16 in every format.
FP8_GEMM_SPEEDUP = 2.0
# (C, format) -> decode tokens/s over bf16's that the format is expected to reach
TARGETS = {(1, "fp8"): 1.7, (1, "w4a16"): 2.5, (64, "fp8"): 1.3, (64, "w4a16"): 1.0}

METHOD = """\
One call, in order: the copy bandwidth and bf16 GEMM rate measured in a child
(executor/profiling/device.py); then each format in its own child (loadtests/lab/quant_child.py),
its share of what is left of --time-budget-s as its deadline. Every child builds the same
random weights (seed 0); fp8 and w4a16 encode them into the released layout
(loadtests/lab/quant_layouts.py) and read them back through the loader's load_weights, so the
engine serves exactly what it would load from such a checkpoint. Each child then decodes
greedily the agreement prompts (their tokens are compared with bf16's: a sanity figure, not a
check) and measures the wave at every C through hipfire_serve.LLM (loadtests/lab/peer/drive.py:
decode tok/s = C*N / (tN - t1); greedy, EOS ignored, no prefix caching, decode graphs
captured at first use, kept out of the figures by the best of --repeats). --spec-mode ar decodes
plainly; --spec-mode adaptive lets the engine's policy choose AR or speculation each round with
--draft's drafter (on random weights, acceptance is whatever the model's own repetitions give).
A point that would pass the deadline is skipped and listed.
"""


@dataclass(frozen=True)
class QuantConfig:
    """One call: the shape, the formats, the wave's grid and the budget."""

    model: str = "random:qwen3-8b"  # 'random:NAME': a preset of executor/random_model.py
    formats: tuple[str, ...] = FORMATS
    concurrency: tuple[int, ...] = (1, 4, 16, 64, 128)
    # the wave of `hipfire-bench peer-vllm` (docs/perf/peer-vllm.md): its bf16 column compares
    wave_prompt_len: tuple[int, int] = (512, 1536)  # prompts uniform in [min, max] tokens
    decode_tokens: int = 128  # N after the first token
    repeats: int = 2  # each wave timing is the best of this many
    group_size: int = 128  # w4a16: inputs per scale
    fp8_block: tuple[int, int] = (128, 128)  # fp8: [N, K] block of one weight scale
    agreement_prompts: int = 4
    agreement_tokens: int = 32
    seed: int = 0
    device: str = "auto"
    dtype: str = "bfloat16"  # the dense format's and the activations' dtype
    graphs: str = "lazy"
    # "ar": plain decoding; "adaptive": the engine's policy chooses per round, with `draft`
    spec_mode: str = "ar"
    draft: str = "ngram"  # the adaptive runs' drafter (prompt lookup)
    kv_cache_dtype: str = "auto"  # "fp8": the KV cache in e4m3 with per-head scales
    time_budget_s: float = 540.0

    def peer(self) -> PeerConfig:
        """The wave's settings as the children's driver reads them."""
        hi = self.wave_prompt_len[1]
        return PeerConfig(
            model=self.model,
            engines=("hipfire",),
            workloads=("wave",),
            concurrency=self.concurrency,
            wave_prompt_len=self.wave_prompt_len,
            decode_tokens=self.decode_tokens,
            repeats=self.repeats,
            # no chat workload runs: its lengths only keep the context limit to the wave's
            chat_prompt_len=(hi, 0.0, hi, hi),
            chat_output_len=(1, 0.0, 1, 1),
            seed=self.seed,
            device=self.device,
            dtype=self.dtype,
            hipfire_graphs=self.graphs,
            time_budget_s=self.time_budget_s,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise ValueError(f"--formats: choose from {', '.join(FORMATS)} (got {bad or 'none'})")
        if not self.model.startswith("random:"):
            raise ValueError("--model: a 'random:NAME' shape (the formats encode its weights)")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"--group-size: 32, 64 or 128 (got {self.group_size})")
        if len(self.fp8_block) != 2 or min(self.fp8_block) < 1:
            raise ValueError(f"--fp8-block: BN,BK, both positive (got {self.fp8_block})")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"--kv-cache-dtype: auto or fp8 (got {self.kv_cache_dtype!r})")
        if self.spec_mode not in ("ar", "adaptive"):
            raise ValueError(f"--spec-mode: ar or adaptive (got {self.spec_mode!r})")
        if len(self.wave_prompt_len) != 2:
            raise ValueError(f"--wave-prompt-len: MIN,MAX (got {self.wave_prompt_len})")
        self.peer().validate()


QUICK = QuantConfig(
    model="random:tiny",
    concurrency=(1, 4),
    wave_prompt_len=(16, 40),
    decode_tokens=8,
    repeats=1,
    group_size=32,  # the tiny shape has 64 inputs
    fp8_block=(32, 32),
    agreement_prompts=2,
    agreement_tokens=8,
    device="cpu",
    graphs="off",
    time_budget_s=120.0,
)


def format_roofline(cfg: QuantConfig, shape, weight_bytes: dict, fmt: str, ceilings: dict):
    """Per C the decode step's bound for one format: its weight bytes (`weight_bytes`: static
    + per_row x C, as its child counted them) plus the KV of the wave's mean context at the
    copy bandwidth, or its FLOPs (the linear layers at the format's GEMM rate, attention at
    bf16's) if larger. Contexts as in peer/roofline.py: prompt + (N + 1) / 2 per request."""
    bw = (ceilings or {}).get("copy_read_plus_write_TBps")
    gemm = (ceilings or {}).get("bf16_gemm_TFLOPs")
    dense_rate = gemm * (FP8_GEMM_SPEEDUP if fmt == "fp8" else 1.0) if gemm else None
    elt = 1 if cfg.kv_cache_dtype != "auto" else DTYPE_BYTES[cfg.dtype]  # KV bytes per value
    peer = cfg.peer()
    out = []
    for c in cfg.concurrency:
        kv_tokens = sum(wave_lens(peer, c)) + c * (cfg.decode_tokens + 1) / 2
        weights = weight_bytes["static"] + c * weight_bytes["per_row"]
        kv_bytes = kv_tokens * shape.kv_bytes_per_token(elt)
        dense_flops = 2 * matmul_params(shape) * c
        attn_flops = 4 * kv_tokens * shape.q_size * shape.num_layers  # q.k and p.v
        bytes_ms = (weights + kv_bytes) / (bw * 1e12) * 1e3 if bw else None
        flops_ms = None
        if gemm:
            flops_ms = (dense_flops / dense_rate + attn_flops / gemm) / 1e12 * 1e3
        step_ms = max(bytes_ms, flops_ms or 0.0) if bytes_ms else None
        out.append(
            {
                "C": c,
                "weight_bytes": weights,
                "kv_bytes": kv_bytes,
                "bytes_ms": bytes_ms,
                "flops_ms": flops_ms,
                "step_ms": step_ms,
                "decode_tok_s": c / step_ms * 1e3 if step_ms else None,
            }
        )
    return out


def agreement(base: list[list[int]], other: list[list[int]]) -> dict | None:
    """Greedy tokens of a format against bf16's, prompt by prompt: the share of positions
    holding the same token, the mean length of the common prefix, prompts fully identical."""
    if not base or not other or len(base) != len(other):
        return None
    same = total = 0
    prefixes = []
    for a, b in zip(base, other):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        prefix = next((i for i in range(n) if a[i] != b[i]), n)
        prefixes.append(prefix)
    return {
        "prompts": len(base),
        "tokens": max(map(len, base)),
        "position_match": same / total if total else None,
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "identical_prompts": sum(p == len(a) == len(b) for p, a, b in zip(prefixes, base, other)),
    }


def _ratio(num, den) -> float | None:
    return num / den if num and den else None


def ratios(formats: dict) -> list[dict]:
    """Per C of the baseline: each other format's decode tok/s over bf16's, and the same
    ratio of their rooflines."""
    base = {p["C"]: p for p in formats.get(BASELINE, {}).get("wave", [])}
    base_roof = {r["C"]: r for r in formats.get(BASELINE, {}).get("roofline", [])}
    rows = []
    for c in sorted(base):
        row: dict = {"C": c}
        for name, res in formats.items():
            if name == BASELINE:
                continue
            point = {p["C"]: p for p in res.get("wave", [])}.get(c, {})
            roof = {r["C"]: r for r in res.get("roofline", [])}.get(c, {})
            row[name] = _ratio(point.get("decode_tok_s"), base[c]["decode_tok_s"])
            row[f"{name}_roofline"] = _ratio(
                roof.get("decode_tok_s"), base_roof.get(c, {}).get("decode_tok_s")
            )
        rows.append(row)
    return rows


def target_checks(rows: list[dict]) -> list[dict]:
    by_c = {r["C"]: r for r in rows}
    out = []
    for (c, fmt), target in TARGETS.items():
        ratio = by_c.get(c, {}).get(fmt)
        out.append(
            {
                "C": c,
                "format": fmt,
                "target": target,
                "ratio": ratio,
                "met": None if ratio is None else ratio >= target,
            }
        )
    return out


def build_record(cfg: QuantConfig, shape, ceilings: dict, results: dict, meta: dict) -> dict:
    """The call's record from the children's results (each format's own roofline and its
    greedy agreement with bf16 added)."""
    base_tokens = results.get(BASELINE, {}).get("greedy_tokens")
    formats = {}
    for name, res in results.items():
        res = dict(res)
        weight_bytes = (res.get("format") or {}).get("weight_bytes")
        res["roofline"] = (
            format_roofline(cfg, shape, weight_bytes, name, ceilings) if weight_bytes else []
        )
        res["agreement"] = (
            None if name == BASELINE else agreement(base_tokens, res.get("greedy_tokens"))
        )
        formats[name] = res
    rows = ratios(formats)
    return {
        "benchmark": "quant",
        "config": cfg.to_json(),
        "meta": meta,
        "ceilings": ceilings,
        "shape": {
            "model": cfg.model,
            "num_params": num_params(shape),
            "kv_bytes_per_token": shape.kv_bytes_per_token(DTYPE_BYTES[cfg.dtype]),
        },
        "formats": formats,
        "ratios": rows,
        "targets": target_checks(rows),
    }
