"""Drafters side by side on the embedded demo target: output tokens/s and acceptance length per
drafter, speculation mode, concurrency and text kind, with every greedy output checked
against plain AR's for the same prompt.

    hipfire-bench demo-drafters --data .devdata --block DIR --out docs/perf
    hipfire-bench demo-drafters --data .devdata --block DIR --device cuda --seconds 10

Uses project internals (the engine, driven directly). Writes `block-drafting-demo.md` and
`block-drafting-demo.json` under `--out`; exits 1 when a greedy output differs from AR's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loadtests.lab.cli_args import int_tuple

METHOD = """\
Every drafter runs in its own engine (`Engine`, spec mode `ar` for none, else each of
`--modes`); prefix caching is off, so a prompt used again costs what it did the first time.
A point keeps C greedy requests live (refill: a finished request is replaced at once), the
n-th request of a kind taking prompt n modulo the pool. The first C requests to finish are the
warm-up; then output tokens are counted over a window of `--seconds` (the device synchronised
at both ends). Acceptance length: accepted drafts + 1 per speculating request-round, over the
window's rounds. A re-ranker keeps learning across its engine's points, in the table's order.
Every finished request's tokens are compared with AR's for the same prompt (AR's own across
concurrencies too)."""

KINDS = ("code", "prose")
DRAFTERS = ("none", "ngram", "draft-model", "block", "block-rerank")
CHAIN = "draft-model"  # the drafter acceptance lengths are compared with


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    draft: str  # EngineConfig.draft
    rerank: bool
    spec_depth: int
    modes: tuple[str, ...]


@dataclass
class Point:
    drafter: str
    mode: str
    concurrency: int
    kind: str
    seconds: float
    output_tokens: int
    tokens_per_s: float
    num_rounds: int
    spec_request_rounds: int  # request-rounds that speculated
    decode_request_rounds: int  # request-rounds that decoded (AR or speculating)
    num_drafted: int
    num_accepted: int
    acceptance_len: float | None  # (accepted + spec request-rounds) / spec request-rounds
    finished_requests: int
    over_ar_tokens_per_s: float | None = None
    over_chain_acceptance_len: float | None = None

    @property
    def spec_share(self) -> float | None:
        """The decoding request-rounds that speculated."""
        rounds = self.decode_request_rounds
        return self.spec_request_rounds / rounds if rounds else None


# -- set-up -------------------------------------------------------------------------------------
def drafter_specs(
    names: Sequence[str], block_dir: str | None, spec_depth: int, modes: Sequence[str]
) -> list[DrafterSpec]:
    """The drafters to run, AR ('none') first whether named or not. A block drafter's depth is
    capped at its block's rows."""
    from hipfire_serve.demo import demo_draft_dir

    unknown = sorted(set(names) - set(DRAFTERS))
    if unknown:
        raise ValueError(f"unknown drafter(s) {', '.join(unknown)} (choose {', '.join(DRAFTERS)})")
    block_depth = spec_depth
    if any(n.startswith("block") for n in names):
        if block_dir is None:
            raise ValueError("the block drafters need --block DIR")
        config = json.loads((Path(block_dir) / "config.json").read_text())
        block_depth = min(spec_depth, int(config["block_size"]))
    specs = [DrafterSpec("none", "none", False, spec_depth, ("ar",))]
    for name in names:
        if name == "none":
            continue
        draft = {"ngram": "ngram", CHAIN: str(demo_draft_dir())}.get(name, block_dir)
        depth = block_depth if name.startswith("block") else spec_depth
        specs.append(DrafterSpec(name, draft, name == "block-rerank", depth, tuple(modes)))
    return specs


def load_prompts(
    data: Path, num_prompts: int, prompt_len: int, span: int, seed: int
) -> dict[str, list[list[int]]]:
    """Per kind, `num_prompts` windows of its val stream, each followed by `span` tokens of the
    same document."""
    from hipfire_serve.demo.evaluate import pick_prompts

    manifest = json.loads((data / "manifest.json").read_text())
    stop_id = manifest["special_token_ids"]["<|endoftext|>"]
    prompts = {}
    for i, kind in enumerate(KINDS):
        stream = np.load(data / f"{kind}_val.npy")
        picked = pick_prompts(stream, num_prompts, prompt_len, span, seed + i, stop_id)
        prompts[kind] = picked.tolist()
    return prompts


def build_engine(spec: DrafterSpec, mode: str, args: argparse.Namespace):
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    config = EngineConfig(
        model="demo",
        draft=spec.draft,
        draft_rerank=spec.rerank,
        spec_mode=mode,
        spec_depth=spec.spec_depth,
        max_concurrency=max(args.concurrency),
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        graphs=args.graphs,
        cost_profile=args.cost_profile,
        enable_prefix_caching=False,
        seed=args.seed,
    )
    return Engine(config)


# -- one point ----------------------------------------------------------------------------------
def acceptance(rounds: Iterable) -> dict:
    """Speculating and decoding request-rounds, drafts and accepted drafts of `RoundStats`
    records, and the acceptance length (None without a speculating request-round)."""
    spec = decode = drafted = accepted = 0
    for r in rounds:
        spec += r.num_spec
        decode += r.num_spec + r.num_ar
        drafted += sum(r.drafted_per_pos)
        accepted += sum(r.accepted_per_pos)
    return {
        "spec_request_rounds": spec,
        "decode_request_rounds": decode,
        "num_drafted": drafted,
        "num_accepted": accepted,
        "acceptance_len": (accepted + spec) / spec if spec else None,
    }


def run_point(
    engine,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    max_tokens: int,
    seconds: float,
    sync: Callable[[], None] = lambda: None,
    tag: str = "r",
) -> tuple[dict, dict[int, list[int]]]:
    """Refill at `concurrency` for a warm-up wave and a timed window, then aborts what is left.
    -> (the window's figures, finished requests' tokens by prompt index)."""
    from hipfire_serve.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    prompt_of: dict[str, int] = {}
    finished: dict[int, list[int]] = {}
    counter = iter(range(1 << 62))

    def add() -> None:
        n = next(counter)
        rid = f"{tag}-{n}"
        prompt_of[rid], tokens[rid] = n % len(prompts), []
        engine.add_request(rid, list(prompts[n % len(prompts)]), params)

    def step() -> tuple[int, int]:
        """One engine step with refill -> (output tokens, requests finished)."""
        num_tokens = num_done = 0
        for out in engine.step():
            for c in out.outputs:
                tokens[out.request_id] += c.token_ids
                num_tokens += len(c.token_ids)
            if out.finished:
                finished.setdefault(prompt_of[out.request_id], tokens.pop(out.request_id))
                num_done += 1
                add()
        return num_tokens, num_done

    for _ in range(concurrency):
        add()
    done = 0
    while done < concurrency:  # the warm-up wave
        done += step()[1]
    engine.stats()  # drains the warm-up's round records
    sync()
    t0 = time.perf_counter()
    num_tokens = num_done = 0
    while time.perf_counter() - t0 < seconds:
        got, ended = step()
        num_tokens, num_done = num_tokens + got, num_done + ended
    sync()
    elapsed = time.perf_counter() - t0
    rounds = engine.stats().rounds
    for rid in list(tokens):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    figures = {
        "seconds": elapsed,
        "output_tokens": num_tokens,
        "tokens_per_s": num_tokens / elapsed,
        "num_rounds": len(rounds),
        "finished_requests": num_done,
        **acceptance(rounds),
    }
    return figures, finished


# -- greedy check and ratios --------------------------------------------------------------------
def greedy_mismatches(
    reference: dict[tuple, list[int]], outputs: dict[tuple, list[int]], label: str
) -> tuple[int, list[dict]]:
    """Compares `outputs` with `reference` (AR's tokens) key by key; keys only one side has are
    skipped. -> (outputs compared, one record per mismatch with the first differing index)."""
    compared, mismatches = 0, []
    for key, got in outputs.items():
        want = reference.get(key)
        if want is None:
            continue
        compared += 1
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            first = min(len(got), len(want)) if first is None else first
            mismatches.append({"run": label, "key": list(key), "first_diff": first})
    return compared, mismatches


def add_ratios(points: list[Point]) -> None:
    """tokens/s over AR's and acceptance length over the chain draft model's (same mode), each
    at the same concurrency and kind."""
    ar = {(p.concurrency, p.kind): p for p in points if p.drafter == "none"}
    chain = {(p.mode, p.concurrency, p.kind): p for p in points if p.drafter == CHAIN}
    for p in points:
        base = ar.get((p.concurrency, p.kind))
        if base is not None and base.tokens_per_s > 0:
            p.over_ar_tokens_per_s = p.tokens_per_s / base.tokens_per_s
        c = chain.get((p.mode, p.concurrency, p.kind))
        if c is not None and c.acceptance_len and p.acceptance_len is not None:
            p.over_chain_acceptance_len = p.acceptance_len / c.acceptance_len


# -- report -------------------------------------------------------------------------------------
def machine(device: str) -> dict:
    import torch

    gpu = torch.cuda.get_device_name(torch.device(device)) if device != "cpu" else None
    return {
        "device": device,
        "name": gpu or f"CPU, {os.cpu_count()} cores",
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(points: Sequence[Point]) -> str:
    head = (
        "| drafter | mode | C | kind | tokens/s | / AR | acceptance len | / chain | spec share |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {p.drafter} | {p.mode} | {p.concurrency} | {p.kind} | {p.tokens_per_s:.0f} | "
        f"{_f(p.over_ar_tokens_per_s, '.2f')} | {_f(p.acceptance_len, '.2f')} | "
        f"{_f(p.over_chain_acceptance_len, '.2f')} | {_f(p.spec_share, '.2f')} |"
        for p in points
    ]
    return "\n".join([head, *rows])


def render_markdown(record: dict, points: Sequence[Point]) -> str:
    m, s, check = record["machine"], record["settings"], record["greedy_check"]
    verdict = (
        f"all {check['compared']} outputs equal AR's"
        if check["ok"]
        else f"**{len(check['mismatches'])} of {check['compared']} outputs differ from AR's**"
    )
    drafters = "\n".join(
        f"- `{d['name']}`: depth {d['spec_depth']}"
        + (f", `{d['draft_name']}`" if d["name"].startswith("block") else "")
        for d in record["drafters"]
    )
    return f"""# Drafters on the demo target

```
{record["command"]}
```

{record["date"]}; {m["name"]}; torch {m["torch"]}; dtype {s["dtype"]}. Prompts of
{s["prompt_len"]} tokens from the corpus's val streams ({s["num_prompts"]} per kind), greedy,
{s["max_tokens"]} output tokens each (EOS ignored), windows of {s["seconds"]} s. Drafters (rows
verified per speculating request, at most):

{drafters}

{table(points)}

/ AR: tokens/s over AR's at the same C and kind, measured in this run. / chain: acceptance length
over the chain draft model's in the same mode. Spec share: the decoding request-rounds that
speculated. Greedy check: {verdict}.

{METHOD}
"""


def write_report(out: Path, record: dict, points: Sequence[Point]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "block-drafting-demo.json").write_text(json.dumps(record, indent=1) + "\n")
    md = render_markdown(record, points)
    (out / "block-drafting-demo.md").write_text(md)
    return md


# -- the run ------------------------------------------------------------------------------------
def run(args: argparse.Namespace, argv: Sequence[str]) -> tuple[dict, list[Point]]:
    import torch

    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    names = [n for n in args.drafters.split(",") if n]
    specs = drafter_specs(names, args.block, args.spec_depth, args.modes.split(","))
    prompts = load_prompts(args.data, args.num_prompts, args.prompt_len, args.max_tokens, args.seed)
    points: list[Point] = []
    reference: dict[tuple, list[int]] = {}
    compared, mismatches = 0, []
    drafters = []
    for spec in specs:
        entry = {**asdict(spec), "draft_name": Path(spec.draft).name if "/" in spec.draft else ""}
        entry.pop("draft")
        for mode in spec.modes:
            engine = build_engine(spec, mode, args)
            for c in args.concurrency:
                for kind in KINDS:
                    figures, finished = run_point(
                        engine, prompts[kind], c, args.max_tokens, args.seconds, sync, f"{kind}{c}"
                    )
                    point = Point(spec.name, mode, c, kind, **figures)
                    points.append(point)
                    print(
                        f"{spec.name:>12} {mode:>8} C={c:<3} {kind:>5}: "
                        f"{point.tokens_per_s:8.1f} tokens/s, acceptance length "
                        f"{_f(point.acceptance_len, '.2f')}",
                        flush=True,
                    )
                    # AR's first output of a prompt is the reference, its later ones checked too
                    outputs = {(kind, i): toks for i, toks in finished.items()}
                    n, bad = greedy_mismatches(reference, outputs, f"{spec.name}/{mode}/C={c}")
                    compared, mismatches = compared + n, mismatches + bad
                    if spec.name == "none":
                        for key, toks in outputs.items():
                            reference.setdefault(key, toks)
            reranker = getattr(engine.drafter, "reranker", None)
            if reranker is not None:
                entry.setdefault("reranker", {})[mode] = reranker.stats()
            del engine
            gc.unfreeze()  # the engine froze its set-up out of the collector's scans
            gc.collect()
            if args.device != "cpu":
                torch.cuda.empty_cache()
        drafters.append(entry)
    add_ratios(points)
    record = {
        "benchmark": "demo_drafters",
        "command": " ".join(["hipfire-bench demo-drafters", *_shown(argv)]),
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.device),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "data", "block")},
            "concurrency": list(args.concurrency),
        },
        "drafters": drafters,
        "points": [asdict(p) for p in points],
        "greedy_check": {"compared": compared, "mismatches": mismatches, "ok": not mismatches},
    }
    return record, points


def _shown(argv: Sequence[str]) -> list[str]:
    """The command line with absolute paths shown by their last part."""
    return [Path(a).name if Path(a).is_absolute() else a for a in argv]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hipfire-bench demo-drafters",
        description=__doc__.split("\n\n")[0],
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", type=Path, default=Path(".devdata"), help="corpus folder")
    parser.add_argument("--block", default=None, help="block drafter directory")
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated")
    parser.add_argument("--modes", default="spec,adaptive", help="spec modes of the drafters")
    parser.add_argument("--concurrency", type=int_tuple, default=(1, 16), help="e.g. 1,16")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window per point")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts per kind")
    parser.add_argument("--spec-depth", type=int, default=8, help="capped at a block's rows")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, else bfloat16")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--graphs", default="lazy", choices=("lazy", "startup", "off"))
    parser.add_argument("--cost-profile", default="auto", help="as the engine's setting")
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="report folder")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.block is None and args.drafters == ",".join(DRAFTERS):
        args.drafters = ",".join(d for d in DRAFTERS if not d.startswith("block"))
        print("no --block DIR: the block drafters are left out", flush=True)
    record, points = run(args, argv)
    print(table(points))
    if args.out is not None:
        write_report(args.out, record, points)
    check = record["greedy_check"]
    if not check["ok"]:
        print(f"FAIL: {len(check['mismatches'])} greedy outputs differ from AR's", flush=True)
        for m in check["mismatches"]:
            print(f"  {m['run']} {m['key']}: first difference at token {m['first_diff']}")
        return 1
    print(f"greedy check: all {check['compared']} outputs equal AR's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
