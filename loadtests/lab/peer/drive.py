"""The measurements, the same code for both engines, over a small `Backend` each child adapts its
engine to; and the children's common main (spec in, result JSON out, rewritten after every point
so a child stopped at its deadline still leaves what it measured).

wave at C (`repeats` times each, the best kept):
  t1 = wall time of generate(max_tokens=1)      (prefill of the wave + one token)
  tN = wall time of generate(max_tokens=1+N)
  decode tok/s = C*N / (tN - t1), step ms = (tN - t1) / N, wave tok/s = C*(1+N) / tN
chat at C: requests kept C live through the engine's own add/step loop; output tok/s = all
output tokens over the run's wall time (drain included); TTFT = first token's arrival after the
request's add; ITL = gaps between a request's later arrivals (a step bringing k tokens: k gaps
of 1/k of it). multiturn at C: the same loop over conversations, a turn sent when the one
before it is done, TTFT also split into first and later turns (the later ones are where a
prefix cache pays). Arrivals are host times of the step outputs in this process, for both
engines."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from loadtests.lab.peer.config import PeerConfig
from loadtests.lab.peer.workloads import chat_requests, multiturn_requests, wave_prompts
from loadtests.stats import summarize

# A chat run whose engine emits no token for this long is stuck; it is stopped with an error.
STALL_S = 300.0
# A point is skipped when the time left is below this multiple of its expected time.
FIT_MARGIN = 1.2


class Backend(Protocol):
    """An engine's offline loop; it may also have `cache_counts() -> (queries, hits)`, the
    prefix cache's token counters so far, and `round_routes() -> str`, one letter per round
    since the last call ('A' plain, 'S' speculative decode, others prefill)."""

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Runs all prompts greedily, ignoring EOS; the output length of each."""

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None: ...

    def step(self) -> list[tuple[str, int, bool]]:
        """One engine step: (req_id, new tokens, finished) per request that moved."""


def _timed(backend: Backend, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    lens = backend.generate(prompts, max_tokens)
    dt = time.perf_counter() - t0
    if any(n != max_tokens for n in lens):
        raise RuntimeError(f"short output: {min(lens)} of {max_tokens} tokens")
    return dt


def wave_point(backend: Backend, cfg: PeerConfig, c: int, vocab: int) -> dict:
    prompts = wave_prompts(cfg, c, vocab)
    n = cfg.decode_tokens
    t1 = min(_timed(backend, prompts, 1) for _ in range(cfg.repeats))
    routes = getattr(backend, "round_routes", None)
    if routes is not None:
        routes()  # the rounds so far are not the decode's
    tn = min(_timed(backend, prompts, 1 + n) for _ in range(cfg.repeats))
    decode_s = tn - t1
    point = {
        "C": c,
        "prompt_tokens": sum(map(len, prompts)),
        "t1_s": t1,
        "tN_s": tn,
        "decode_tok_s": c * n / decode_s if decode_s > 0 else None,
        "step_ms": 1e3 * decode_s / n if decode_s > 0 else None,
        "wave_tok_s": c * (1 + n) / tn if tn > 0 else None,
    }
    if routes is not None:
        decode = routes()
        rounds = sum(decode.count(r) for r in "AS")
        point["spec_share"] = decode.count("S") / rounds if rounds else None
    return point


class _LiveRun:
    """Arrival, first- and last-token times and token counts of the requests of a live run."""

    def __init__(self) -> None:
        self.want: dict[str, int] = {}
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.got: dict[str, int] = {}
        self.itl: list[float] = []
        self.tpot: list[float] = []

    def summary(self, c: int, requests: list[tuple[list[int], int]], wall: float) -> dict:
        num_out = sum(self.got.values())
        return {
            "C": c,
            "num_requests": len(requests),
            "prompt_tokens": sum(len(p) for p, _ in requests),
            "output_tokens": num_out,
            "wall_s": wall,
            "output_tok_s": num_out / wall,
            "requests_per_s": len(requests) / wall,
            "ttft": summarize(arrival_gaps(self.first, self.arrival)),
            "itl": summarize(self.itl),
            "tpot": summarize(self.tpot),
        }


def live_run(
    backend: Backend, c: int, conversations: list[list[tuple[list[int], int]]], tag: str
) -> tuple[_LiveRun, float]:
    """Keeps `c` conversations live until all are done: a conversation's requests go one after
    the other (the next when the one before finishes), a finished conversation is replaced by
    the next at once. Returns the run's times and its wall time."""
    pending = deque(enumerate(conversations))
    run = _LiveRun()
    live: dict[str, tuple[int, int]] = {}  # req_id -> (conversation, turn)

    def send(conv: int, turn: int) -> None:
        prompt, max_tokens = conversations[conv][turn]
        rid = f"{tag}-{c}-{conv}" + (f"-{turn}" if len(conversations[conv]) > 1 else "")
        run.want[rid], run.got[rid] = max_tokens, 0
        run.arrival[rid] = time.perf_counter()
        backend.add(rid, prompt, max_tokens)
        live[rid] = (conv, turn)

    t0 = t_token = time.perf_counter()
    while pending or live:
        while pending and len(live) < c:
            send(pending.popleft()[0], 0)
        outs = backend.step()
        now = time.perf_counter()
        for rid, num, finished in outs:
            if num:
                t_token = now
                if run.got[rid]:
                    run.itl.extend([(now - run.last[rid]) / num] * num)
                else:
                    run.first[rid] = now
                run.got[rid] += num
                run.last[rid] = now
            if finished:
                conv, turn = live.pop(rid)
                if run.got[rid] != run.want[rid]:
                    raise RuntimeError(f"short output: {run.got[rid]} of {run.want[rid]} tokens")
                if run.got[rid] > 1:
                    run.tpot.append((run.last[rid] - run.first[rid]) / (run.got[rid] - 1))
                if turn + 1 < len(conversations[conv]):
                    send(conv, turn + 1)
        if now - t_token > STALL_S:
            raise RuntimeError(f"no token for {STALL_S:.0f} s with {len(live)} requests live")
    return run, time.perf_counter() - t0


def chat_point(backend: Backend, cfg: PeerConfig, c: int, vocab: int) -> dict:
    requests = chat_requests(cfg, c, vocab)
    run, wall = live_run(backend, c, [[r] for r in requests], "chat")
    return run.summary(c, requests, wall)


def multiturn_point(backend: Backend, cfg: PeerConfig, c: int, vocab: int) -> dict:
    conversations = multiturn_requests(cfg, c, vocab)
    counts = getattr(backend, "cache_counts", None)
    before = counts() if counts else None
    run, wall = live_run(backend, c, conversations, "mt")
    requests = [r for conv in conversations for r in conv]
    point = run.summary(c, requests, wall)
    later = {rid for rid in run.first if not rid.endswith("-0")}
    point["num_conversations"] = len(conversations)
    point["ttft_first_turn"] = summarize(
        [run.first[r] - run.arrival[r] for r in run.first if r not in later]
    )
    point["ttft_later_turns"] = summarize([run.first[r] - run.arrival[r] for r in later])
    if before is not None:
        queries, hits = (a - b for a, b in zip(counts(), before))
        point["prefix_cache"] = {"queries": queries, "hits": hits}
    return point


def arrival_gaps(first: dict[str, float], arrival: dict[str, float]) -> list[float]:
    return [first[rid] - arrival[rid] for rid in first]


POINTS: dict[str, Callable[[Backend, PeerConfig, int, int], dict]] = {
    "wave": wave_point,
    "chat": chat_point,
    "multiturn": multiturn_point,
}


def warm_wave(backend: Backend, cfg: PeerConfig, vocab: int) -> None:
    c = min(4, max(cfg.concurrency))
    backend.generate(wave_prompts(cfg, c, vocab, seed_offset=9), 8)


def warm_chat(backend: Backend, cfg: PeerConfig, vocab: int) -> None:
    for i, prompt in enumerate(wave_prompts(cfg, 2, vocab, seed_offset=10)):
        backend.add(f"warm-{i}", prompt, 4)
    pending, t0 = 2, time.perf_counter()
    while pending:
        pending -= sum(1 for _, _, finished in backend.step() if finished)
        if time.perf_counter() - t0 > STALL_S:
            raise RuntimeError(f"warm-up requests unfinished after {STALL_S:.0f} s")


# Unmeasured runs before a workload's first point: lazy set-up stays out of the points.
WARM_UPS: dict[str, Callable[[Backend, PeerConfig, int], None]] = {
    "wave": warm_wave,
    "chat": warm_chat,
    "multiturn": warm_chat,
}


def run_points(
    backend: Backend,
    cfg: PeerConfig,
    vocab: int,
    deadline: float,
    result: dict,
    save: Callable[[], None],
) -> None:
    """Every (workload, C) point into `result`, in grid order, until `deadline` (epoch
    seconds): a point whose expected time (the previous point's, scaled by C) does not fit is
    skipped, and so are the larger ones after it. A warm-up or point that raises is listed and
    stops its workload."""
    for workload in cfg.workloads:
        result.setdefault(workload, [])
        try:
            WARM_UPS[workload](backend, cfg, vocab)
        except Exception as e:
            result["errors"].append({"workload": workload, "C": None, "error": one_line(e)})
            save()
            continue
        prev: tuple[int, float] | None = None
        for c in cfg.concurrency:
            expect = prev[1] * c / prev[0] if prev else 0.0
            if time.time() + FIT_MARGIN * expect > deadline:
                result["skipped"].append({"workload": workload, "C": c, "expected_s": expect})
                continue
            t0 = time.perf_counter()
            try:
                point = POINTS[workload](backend, cfg, c, vocab)
            except Exception as e:
                result["errors"].append({"workload": workload, "C": c, "error": one_line(e)})
                save()
                break
            prev = (c, time.perf_counter() - t0)
            point["elapsed_s"] = prev[1]
            result[workload].append(point)
            print(f"[{result['engine']}] {workload} {json.dumps(point)}", flush=True)
            save()


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0] if text else type(e).__name__


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def child_main(engine: str, build: Callable[[dict, dict], tuple[Backend, int]]) -> int:
    """`python -m loadtests.lab.peer.<engine>_child SPEC OUT`: builds the backend
    (`build(spec, result)` fills the result's versions and settings and returns the backend and
    the vocabulary size), measures every point and writes OUT."""
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    cfg = PeerConfig.from_json(spec["config"])
    result: dict = {"engine": engine, "skipped": [], "errors": []}
    t0 = time.perf_counter()
    try:
        backend, vocab = build(spec, result)
        result["startup_s"] = time.perf_counter() - t0
    except Exception as e:
        result["error"] = one_line(e)
        write_json(out_path, result)
        print(f"[{engine}] failed: {result['error']}", file=sys.stderr, flush=True)
        return 1
    write_json(out_path, result)
    run_points(backend, cfg, vocab, spec["deadline"], result, lambda: write_json(out_path, result))
    result["elapsed_s"] = time.perf_counter() - t0
    write_json(out_path, result)
    return 0
