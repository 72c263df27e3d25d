"""Probe of programmatic dependent launch (PDL) on the decode forward: CUDA-graph replays of the
random-weight Qwen3-8B-shaped target and Qwen3-0.6B-shaped draft model with PDL off and on.

    hipfire-bench pdl --out DIR [--models qwen3-8b,qwen3-0.6b] [--rows 1,4,16]

Per model and row count (rows = decoding sequences of one row each, every one over
`--context` tokens of random cached KV) it captures two decode graphs in the same process,
one under `pdl_forced(False)` and one under `pdl_forced(True)` (executor/graphs.py, the
engine's own graphs), checks that both give bit-identical logits, and times their replays in
alternating rounds (CUDA events; the median of the rounds' means). It prints a table and writes
DIR/pdl.json and DIR/pdl.md with the GPU, the date and each time as a ratio to the PDL-off
graph. Where the GPU or Triton cannot launch with PDL, both graphs are PDL-off and the record
says so. A harness over the executor's forward, so it imports `executor` (lazily).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MODELS = ("qwen3-8b", "qwen3-0.6b")
ROWS = (1, 4, 16)
CONTEXT_LEN = 1024
PAGE_SIZE = 16


@dataclass(frozen=True)
class DecodeBatch:
    """One decode round's inputs: `num_seqs` sequences of `q_len` new rows each after
    `context_len` cached tokens; sequence s owns the blocks s * blocks_per_seq onwards."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    cu_q_lens: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, blocks_per_seq] int32
    q_len: int

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


def blocks_per_seq(context_len: int, q_len: int, page_size: int = PAGE_SIZE) -> int:
    return -(-(context_len + q_len) // page_size)


def decode_batch(
    num_seqs: int,
    q_len: int,
    context_len: int,
    vocab_size: int,
    device: torch.device,
    *,
    page_size: int = PAGE_SIZE,
    seed: int = 0,
) -> DecodeBatch:
    num_blocks = blocks_per_seq(context_len, q_len, page_size)
    gen = torch.Generator().manual_seed(seed)
    tables = torch.arange(num_seqs * num_blocks, dtype=torch.int64).view(num_seqs, num_blocks)
    positions = (context_len + torch.arange(q_len)).repeat(num_seqs)  # [rows]
    owners = torch.arange(num_seqs).repeat_interleave(q_len)  # [rows]
    pages = tables[owners, positions // page_size]
    slots = pages * page_size + positions % page_size  # [rows]
    cu_q_lens = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len

    def dev(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).to(device)

    ids = torch.randint(0, vocab_size, (num_seqs * q_len,), generator=gen)  # [rows]

    return DecodeBatch(
        input_ids=dev(ids, torch.int64),
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        cu_q_lens=dev(cu_q_lens, torch.int32),
        seq_lens=dev(torch.full((num_seqs,), context_len + q_len), torch.int32),
        block_tables=dev(tables, torch.int32),
        q_len=q_len,
    )


def random_caches(model, num_blocks: int, *, seed: int = 0):
    """Per-layer K and V caches of `num_blocks` pages filled with N(0, 1) (a random context)."""
    from executor.kv_cache import KVCache

    kv = KVCache.allocate(
        model.config, num_blocks=num_blocks, block_size=PAGE_SIZE, dtype=model.dtype,
        device=model.device,
    )  # fmt: skip
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for k, v in zip(kv.k, kv.v):
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    return kv


class GraphPair:
    """The same decode round captured twice, with PDL off and on (engine graphs, each with its
    own static buffers): `graph(pdl)` is one of the two, `logits(pdl)` runs the round on it."""

    def __init__(self, model, kv, batch: DecodeBatch):
        from executor.graphs import DecodeGraphs, bucket_for
        from kernels.arch import pdl_forced

        num_seqs = batch.seq_lens.shape[0]
        self.bucket = bucket_for(batch.num_rows)
        self.graphs = {}
        for pdl in (False, True):
            graphs = DecodeGraphs(
                model, kv.k, kv.v, max_seqs=num_seqs,
                max_blocks_per_seq=batch.block_tables.shape[1], max_rows=self.bucket,
            )  # fmt: skip
            with pdl_forced(pdl):  # decided at capture: the graph keeps its launches
                self._run(graphs, batch)
            self.graphs[pdl] = graphs
        self.batch = batch

    @staticmethod
    def _run(graphs, batch: DecodeBatch) -> torch.Tensor:
        return graphs.run(
            graphs.max_rows, batch.input_ids, batch.positions, batch.slot_mapping,
            batch.cu_q_lens, batch.seq_lens, batch.block_tables, max_q_len=batch.q_len,
        )  # fmt: skip

    def logits(self, pdl: bool) -> torch.Tensor:
        """Runs the round (inputs copied into the graph's buffers, one replay); [rows, vocab]."""
        return self._run(self.graphs[pdl], self.batch).clone()

    def graph(self, pdl: bool) -> torch.cuda.CUDAGraph:
        ((graph, _),) = self.graphs[pdl].graphs.values()
        return graph


def time_replays(graphs: dict, replays: int, rounds: int) -> dict:
    """Median over `rounds` of the mean time of `replays` back-to-back replays (us), the rounds
    alternating between the graphs so that clock drift meets each alike; also the spread."""
    samples = {key: [] for key in graphs}
    for graph in graphs.values():  # warm: first replays upload the graph
        graph.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for key, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) * 1e3 / replays)
    return {
        key: {"median_us": statistics.median(s), "min_us": min(s), "max_us": max(s)}
        for key, s in samples.items()
    }


def record_for(model_name: str, rows: int, times: dict, identical: bool, max_abs_diff: float):
    off, on = times[False]["median_us"], times[True]["median_us"]
    return {
        "model": model_name,
        "rows": rows,
        "num_seqs": rows,
        "q_len": 1,
        "off_us": round(off, 2),
        "on_us": round(on, 2),
        "ratio": round(on / off, 4),
        "saved_us": round(off - on, 2),
        "off_range_us": [round(times[False]["min_us"], 2), round(times[False]["max_us"], 2)],
        "on_range_us": [round(times[True]["min_us"], 2), round(times[True]["max_us"], 2)],
        "identical": identical,
        "max_abs_diff": max_abs_diff,
    }


_HEADER = (
    "| model | rows | PDL off us | PDL on us | on / off | saved us | identical |\n"
    "|---|---|---|---|---|---|---|"
)


def table_lines(records: list[dict]) -> list[str]:
    lines = [_HEADER]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['rows']} | {r['off_us']:.1f} | {r['on_us']:.1f} | "
            f"{r['ratio']:.3f} | {r['saved_us']:.1f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return lines


def write_report(out: Path, meta: dict, records: list[dict]) -> dict:
    """Writes out/pdl.json (meta + records) and out/pdl.md; returns the JSON record."""
    out.mkdir(parents=True, exist_ok=True)
    record = {**meta, "records": records}
    (out / "pdl.json").write_text(json.dumps(record, indent=1) + "\n")
    pdl_note = (
        ""
        if meta["pdl_capable"]
        else (" PDL could not be used here (GPU or Triton): both graphs are PDL-off.")
    )
    lines = [
        f"# Programmatic dependent launch on the decode forward, {meta['device']}, {meta['date']}",
        "",
        f"Random-weight models, bf16, {meta['context_len']} tokens of cached context per "
        "sequence, one row per sequence; CUDA-graph replays of the whole forward and LM head, "
        f"median of {meta['rounds']} rounds of {meta['replays']} replays, PDL-off and PDL-on "
        f"graphs alternating (torch {meta['torch']}, Triton {meta['triton']}).{pdl_note}",
        "",
        *table_lines(records),
    ]
    (out / "pdl.md").write_text("\n".join(lines) + "\n")
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hipfire-bench pdl", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--context", type=int, default=CONTEXT_LEN)
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    args.models = tuple(args.models.split(","))
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    args.rows = tuple(int(r) for r in args.rows.split(","))
    if any(not 1 <= r <= 16 for r in args.rows):
        parser.error("rows must be 1..16 (the skinny linear's range)")
    if args.context < 1 or args.replays < 1 or args.rounds < 1:
        parser.error("--context, --replays and --rounds must be positive")
    return args


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    from executor.random_model import random_model

    model = random_model(name, device=device, dtype=torch.bfloat16, max_position=args.context + 64)
    num_blocks = max(args.rows) * blocks_per_seq(args.context, 1)
    kv = random_caches(model, num_blocks)
    records = []
    for rows in args.rows:
        batch = decode_batch(rows, 1, args.context, model.config.vocab_size, device, seed=rows)
        pair = GraphPair(model, kv, batch)
        off, on = pair.logits(False), pair.logits(True)
        times = time_replays(
            {pdl: pair.graph(pdl) for pdl in (False, True)}, args.replays, args.rounds
        )
        diff = float((off - on).abs().max())
        rec = record_for(name, rows, times, bool(torch.equal(off, on)), diff)
        print(table_lines([rec])[-1], flush=True)
        records.append(rec)
        del pair
    del model, kv
    torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    from kernels.arch import pdl_capable

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    t0 = time.time()
    device = torch.device("cuda", torch.cuda.current_device())
    capable = pdl_capable(device)
    print(f"{torch.cuda.get_device_name(device)}: PDL {'available' if capable else 'unavailable'}")
    print(_HEADER)
    records = []
    for name in args.models:
        records += bench_model(name, args, device)
    meta = {
        "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl_capable": capable,
        "context_len": args.context,
        "replays": args.replays,
        "rounds": args.rounds,
        "wall_s": round(time.time() - t0, 1),
    }
    write_report(args.out, meta, records)
    print(f"wall {meta['wall_s']} s; wrote {args.out / 'pdl.json'}")
    return 0 if all(r["identical"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
