"""The record of a call: engines' results side by side, ratios ours/vLLM per C, the roofline;
records of several calls merged into one (`merge_records`); `peer-vllm.md`, `.json` and the
plot written from it. Every ratio is a speed ratio, this project's over vLLM's (> 1: ours is
faster): tokens/s over tokens/s, and for times (prefill, TTFT, ITL) vLLM's over ours."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.lab.peer.config import PeerConfig

OURS, PEER, NOCACHE = "hipfire", "vllm", "hipfire-nocache"
# config fields two records must share to be merged (the workloads' definitions)
COMPARABLE = (
    "model",
    "wave_prompt_len",
    "decode_tokens",
    "chat_prompt_len",
    "chat_output_len",
    "chat_waves",
    "chat_min_requests",
    "mt_system_len",
    "mt_turns",
    "mt_user_len",
    "mt_output_len",
    "mt_waves",
    "mt_min_conversations",
    "prefix_caching",
    "seed",
    "dtype",
)


def _ratio(num, den) -> float | None:
    return num / den if num and den else None


def _p(point: dict, metric: str, q: str = "p50_ms"):
    return (point.get(metric) or {}).get(q)


def ratios(engines: dict) -> dict:
    """Per C where both engines have the point: speed ratios ours/vLLM."""
    ours, peer = engines.get(OURS) or {}, engines.get(PEER) or {}
    out: dict[str, list] = {"wave": [], "chat": []}
    peer_wave = {p["C"]: p for p in peer.get("wave", [])}
    for o in ours.get("wave", []):
        if (p := peer_wave.get(o["C"])) is not None:
            out["wave"].append(
                {
                    "C": o["C"],
                    "decode_tok_s": _ratio(o["decode_tok_s"], p["decode_tok_s"]),
                    "wave_tok_s": _ratio(o["wave_tok_s"], p["wave_tok_s"]),
                    "prefill_t1": _ratio(p["t1_s"], o["t1_s"]),
                }
            )
    peer_chat = {p["C"]: p for p in peer.get("chat", [])}
    for o in ours.get("chat", []):
        if (p := peer_chat.get(o["C"])) is not None:
            row = {"C": o["C"], "output_tok_s": _ratio(o["output_tok_s"], p["output_tok_s"])}
            for metric in ("ttft", "itl"):
                for q in ("p50_ms", "p90_ms"):
                    row[f"{metric}_{q[:3]}"] = _ratio(_p(p, metric, q), _p(o, metric, q))
            out["chat"].append(row)
    out["multiturn"] = _multiturn_ratios(ours, peer, engines.get(NOCACHE) or {})
    return out


def _multiturn_ratios(ours: dict, peer: dict, nocache: dict) -> list[dict]:
    """Per C of ours: against vLLM (output tok/s, TTFT) and against ours without the cache
    (`cache_*`: the cache's own gain)."""
    peer_mt = {p["C"]: p for p in peer.get("multiturn", [])}
    base_mt = {p["C"]: p for p in nocache.get("multiturn", [])}
    rows = []
    for o in ours.get("multiturn", []):
        p, b = peer_mt.get(o["C"], {}), base_mt.get(o["C"], {})
        rows.append(
            {
                "C": o["C"],
                "output_tok_s": _ratio(o["output_tok_s"], p.get("output_tok_s")),
                "ttft_p50": _ratio(_p(p, "ttft"), _p(o, "ttft")),
                "cache_output_tok_s": _ratio(o["output_tok_s"], b.get("output_tok_s")),
                "cache_ttft_p50": _ratio(_p(b, "ttft"), _p(o, "ttft")),
                "cache_ttft_later_p50": _ratio(
                    _p(b, "ttft_later_turns"), _p(o, "ttft_later_turns")
                ),
            }
        )
    return rows


def build_record(
    cfg: PeerConfig,
    shape: dict,
    ceilings: dict,
    roofline: list[dict],
    engines: dict,
    missing: dict,
    meta: dict,
) -> dict:
    """The record of one call; `meta`: date, commit, elapsed_s, device, torch."""
    return {
        "benchmark": "peer-vllm",
        **meta,
        "vllm": (engines.get(PEER) or {}).get("version"),
        "config": cfg.to_json(),
        "shape": shape,
        "ceilings": ceilings,
        "roofline": roofline,
        "engines": engines,
        "missing": missing,
        "ratios": ratios(engines),
    }


def merge_records(records: list[dict]) -> dict:
    """One record from several calls on the same workloads (an engine measured in a later
    record replaces an earlier one's); ceilings and roofline from the first that has them.
    ValueError naming what differs where the workloads or the devices do."""
    if not records:
        raise ValueError("nothing to merge")
    base = records[0]
    for rec in records[1:]:
        if rec["device"] != base["device"]:
            raise ValueError(f"records of different devices: {base['device']}, {rec['device']}")
        for name in COMPARABLE:
            if rec["config"][name] != base["config"][name]:
                raise ValueError(
                    f"records differ in {name}: {base['config'][name]} vs {rec['config'][name]}"
                )
    engines: dict = {}
    for rec in records:
        engines.update(rec["engines"])
    measured = next((r for r in records if r.get("ceilings")), base)
    config = dict(base["config"])
    config["engines"] = list(engines)
    config["concurrency"] = sorted({c for r in records for c in r["config"]["concurrency"]})
    missing = {k: v for r in records for k, v in r.get("missing", {}).items() if k not in engines}
    merged = {
        **base,
        "date": max(r["date"] for r in records),
        "commit": ", ".join(dict.fromkeys(r["commit"] for r in records)),
        "elapsed_s": sum(r["elapsed_s"] for r in records),
        "vllm": (engines.get(PEER) or {}).get("version"),
        "config": config,
        "ceilings": measured.get("ceilings") or {},
        "roofline": measured["roofline"],
        "engines": engines,
        "missing": missing,
        "ratios": ratios(engines),
        "merged_from": [
            {"date": r["date"], "commit": r["commit"], "engines": list(r["engines"])}
            for r in records
        ],
    }
    return merged


# -- markdown ------------------------------------------------------------------------------
def _f(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _by_c(points: list[dict]) -> dict[int, dict]:
    return {p["C"]: p for p in points}


def _wave_tables(record: dict) -> list[str]:
    eng = record["engines"]
    ours, peer = _by_c(eng.get(OURS, {}).get("wave", [])), _by_c(eng.get(PEER, {}).get("wave", []))
    roof, rat = _by_c(record["roofline"]), _by_c(record["ratios"]["wave"])
    cs = sorted(set(ours) | set(peer))
    if not cs:
        return []

    def get(points, c, key, digits=0):
        return _f(points.get(c, {}).get(key), digits)

    def share(points, c):
        tok, top = points.get(c, {}).get("decode_tok_s"), roof.get(c, {}).get("decode_tok_s")
        return _f(100 * tok / top, 0) + "%" if tok and top else "-"

    lines = [
        "## Wave: decode",
        "",
        "| C | ours tok/s | vLLM tok/s | ratio | roofline tok/s | ours / roof | vLLM / roof "
        "| ours step ms | vLLM step ms | roofline step ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cs:
        lines.append(
            f"| {c} | {get(ours, c, 'decode_tok_s')} | {get(peer, c, 'decode_tok_s')} "
            f"| {_bold(get(rat, c, 'decode_tok_s', 3))} | {get(roof, c, 'decode_tok_s')} "
            f"| {share(ours, c)} | {share(peer, c)} | {get(ours, c, 'step_ms', 2)} "
            f"| {get(peer, c, 'step_ms', 2)} | {get(roof, c, 'step_ms', 2)} |"
        )
    lines += [
        "",
        "## Wave: prefill and end to end",
        "",
        "| C | prompt tokens | ours t1 s | vLLM t1 s | prefill ratio | ours wave tok/s "
        "| vLLM wave tok/s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cs:
        tokens = (ours.get(c) or peer.get(c))["prompt_tokens"]
        lines.append(
            f"| {c} | {tokens:,} | {get(ours, c, 't1_s', 3)} | {get(peer, c, 't1_s', 3)} "
            f"| {get(rat, c, 'prefill_t1', 3)} | {get(ours, c, 'wave_tok_s')} "
            f"| {get(peer, c, 'wave_tok_s')} | {get(rat, c, 'wave_tok_s', 3)} |"
        )
    return [*lines, ""]


def _chat_table(record: dict) -> list[str]:
    eng = record["engines"]
    ours, peer = _by_c(eng.get(OURS, {}).get("chat", [])), _by_c(eng.get(PEER, {}).get("chat", []))
    rat = _by_c(record["ratios"]["chat"])
    cs = sorted(set(ours) | set(peer))
    if not cs:
        return []

    def lat(points, c, metric, q="p50_ms"):
        return _f(_p(points[c], metric, q), 1) if c in points else "-"

    lines = [
        "## Chat-like: refill at C live requests",
        "",
        "| C | requests | ours out tok/s | vLLM out tok/s | ratio | TTFT p50 ms ours / vLLM "
        "| ratio | TTFT p90 ms ours / vLLM | ITL p50 ms ours / vLLM | ratio "
        "| ITL p90 ms ours / vLLM |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cs:
        num = (ours.get(c) or peer.get(c))["num_requests"]
        r = rat.get(c, {})
        lines.append(
            f"| {c} | {num} | {_f(ours.get(c, {}).get('output_tok_s'))} "
            f"| {_f(peer.get(c, {}).get('output_tok_s'))} | {_bold(_f(r.get('output_tok_s'), 3))} "
            f"| {lat(ours, c, 'ttft')} / {lat(peer, c, 'ttft')} | {_f(r.get('ttft_p50'), 3)} "
            f"| {lat(ours, c, 'ttft', 'p90_ms')} / {lat(peer, c, 'ttft', 'p90_ms')} "
            f"| {lat(ours, c, 'itl')} / {lat(peer, c, 'itl')} | {_f(r.get('itl_p50'), 3)} "
            f"| {lat(ours, c, 'itl', 'p90_ms')} / {lat(peer, c, 'itl', 'p90_ms')} |"
        )
    return [*lines, ""]


def _multiturn_table(record: dict) -> list[str]:
    eng = record["engines"]
    per = {name: _by_c(res.get("multiturn", [])) for name, res in eng.items()}
    cs = sorted({c for points in per.values() for c in points})
    if not cs:
        return []
    rat = _by_c(record["ratios"].get("multiturn", []))
    lines = [
        "## Multi-turn: conversations over a shared system prompt, C live",
        "",
        "| C | engine | prefix caching | requests | out tok/s | TTFT p50 ms | TTFT p90 ms "
        "| TTFT p50 ms, turn 1 / later | ITL p50 ms | cache hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cs:
        for name, points in per.items():
            if (pt := points.get(c)) is None:
                continue
            caching = eng[name].get("settings", {}).get("enable_prefix_caching")
            cache = pt.get("prefix_cache") or {}
            hit = (
                _f(100 * cache["hits"] / cache["queries"], 1) + "%" if cache.get("queries") else "-"
            )
            lines.append(
                f"| {c} | {name} | {_on(caching)} | {pt['num_requests']} "
                f"| {_f(pt['output_tok_s'])} | {_f(_p(pt, 'ttft'), 1)} "
                f"| {_f(_p(pt, 'ttft', 'p90_ms'), 1)} | {_f(_p(pt, 'ttft_first_turn'), 1)} / "
                f"{_f(_p(pt, 'ttft_later_turns'), 1)} | {_f(_p(pt, 'itl'), 1)} | {hit} |"
            )
    lines += [
        "",
        "| C | out tok/s ours / vLLM | TTFT p50 vLLM / ours | TTFT p50 without / with cache "
        "(ours) | later turns | out tok/s with / without cache |",
        "|---|---|---|---|---|---|",
    ]
    for c in cs:
        r = rat.get(c, {})
        lines.append(
            f"| {c} | {_bold(_f(r.get('output_tok_s'), 3))} | {_f(r.get('ttft_p50'), 3)} "
            f"| {_bold(_f(r.get('cache_ttft_p50'), 2))} | {_f(r.get('cache_ttft_later_p50'), 2)} "
            f"| {_f(r.get('cache_output_tok_s'), 3)} |"
        )
    return [*lines, ""]


def _on(value) -> str:
    return "-" if value is None else ("on" if value else "off")


def _issues(record: dict) -> list[str]:
    lines = [f"- {name}: not run ({why})" for name, why in record.get("missing", {}).items()]
    for name, res in record["engines"].items():
        if res.get("error"):
            lines.append(f"- {name}: failed at start-up: {res['error']}")
        for e in res.get("errors", []):
            where = f"{e['workload']} {_where(e['C'])}: " if "workload" in e else ""
            lines.append(f"- {name}: {where}{e['error']}")
        for s in res.get("skipped", []):
            lines.append(
                f"- {name}: {s['workload']} C={s['C']} skipped (expected {s['expected_s']:.0f} s "
                "would pass the time budget)"
            )
    return ["## Not measured", "", *lines, ""] if lines else []


def _where(c: int | None) -> str:
    return "warm-up" if c is None else f"C={c}"


def _bold(text: str) -> str:
    return text if text == "-" else f"**{text}**"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def markdown(record: dict, name: str = "peer-vllm") -> str:
    cfg = record["config"]
    eng = record["engines"]
    ceil = record.get("ceilings") or {}
    sets = {name: res.get("settings", {}) for name, res in eng.items()}
    lo, hi = cfg["wave_prompt_len"]
    pm, ps, plo, phi = cfg["chat_prompt_len"]
    om, osg, olo, ohi = cfg["chat_output_len"]
    head = [
        "# Side by side: hipfire-serve and vLLM",
        "",
        f"Measured on {record['device']}, {record['date']}, torch {record['torch']}, "
        f"vLLM {record.get('vllm') or '-'}, at commit {record['commit']}, by "
        f"`hipfire-bench peer-vllm` in {record['elapsed_s']:.0f} s (JSON: `{name}.json`, "
        f"plot: `{name}.png`).",
        "",
        f"Model `{cfg['model']}` ({record['shape']['dtype']}, "
        f"{_count(record['shape']['num_params'])} parameters), the same shape in both"
        + (
            ": random weights here, vLLM's dummy weights from the same config.json. "
            if cfg["model"].startswith("random:")
            else ", the checkpoint's weights. "
        )
        + "Each engine in its own process, one after the other, on the same token ids; plain "
        "decoding (no speculation), greedy, EOS ignored, prefix caching "
        + ("on in both (hipfire-nocache: ours with it off)" if cfg.get("prefix_caching") else "off")
        + ", `max_num_seqs` / "
        f"`max_concurrency` {max(cfg['concurrency'])}, context {_max_len(cfg)} tokens; "
        "otherwise each at its defaults"
        + "".join(f"; {n}: {_settings_line(n, s)}" for n, s in sets.items() if s)
        + ".",
        "",
        f"- **Wave**: C requests at once, prompts uniform in [{lo}, {hi}] tokens; "
        f"t1 = time of max_tokens = 1, tN = of 1 + {cfg['decode_tokens']}, best of "
        f"{cfg['repeats']}; decode tok/s = C x {cfg['decode_tokens']} / (tN - t1), step ms = "
        f"(tN - t1) / {cfg['decode_tokens']}, wave tok/s = C x (1 + N) / tN.",
        f"- **Chat-like**: max({cfg['chat_waves']} x C, {cfg['chat_min_requests']}) requests, "
        f"C live (a finished one replaced at once), prompts lognormal (median {pm}, sigma {ps}) "
        f"in [{plo}, {phi}] tokens, outputs lognormal (median {om}, sigma {osg}) in [{olo}, "
        f"{ohi}], random tokens (no shared prefixes); output tok/s over the whole run. TTFT and "
        "ITL are host arrival times of each engine's step outputs in its own offline loop "
        "(the same clock and definition for both; vLLM's RequestOutput.metrics is not read).",
        *_multiturn_line(cfg),
        "- **Roofline**: per decode step, every weight once (of the input embedding only the "
        "rows' own) plus the KV of every context at its mean length over the wave's decode "
        "steps, at the copy bandwidth measured in the same call; or the step's FLOPs at the "
        "measured bf16 GEMM rate where that is longer.",
        "- Ratios are speed ratios, ours / vLLM (> 1: ours faster): tokens/s over tokens/s, "
        "and vLLM's time over ours for t1, TTFT and ITL.",
        "",
        (
            f"Ceilings measured in this call: copy {ceil['copy_read_plus_write_TBps']} TB/s "
            f"(read + write), bf16 GEMM {ceil['bf16_gemm_TFLOPs']} TFLOP/s."
            if ceil
            else "No ceilings measured (no GPU): no roofline."
        ),
        "",
    ]
    if record.get("merged_from"):
        parts = "; ".join(
            f"{', '.join(m['engines'])} at {m['date']} ({m['commit']})"
            for m in record["merged_from"]
        )
        head += [f"Merged from separate calls: {parts}.", ""]
    body = _wave_tables(record) + _chat_table(record) + _multiturn_table(record)
    body += _issues(record)
    return "\n".join(head + body + [f"![{name}]({name}.png)", ""])


def _multiturn_line(cfg: dict) -> list[str]:
    if "multiturn" not in cfg["workloads"]:
        return []
    um, us, ulo, uhi = cfg["mt_user_len"]
    om, osg, olo, ohi = cfg["mt_output_len"]
    return [
        f"- **Multi-turn**: max({cfg['mt_waves']} x C, {cfg['mt_min_conversations']}) "
        f"conversations, C live, {cfg['mt_turns']} turns each over one {cfg['mt_system_len']}"
        f"-token system prompt shared by all; user messages lognormal (median {um}, sigma {us}) "
        f"in [{ulo}, {uhi}], replies (median {om}, sigma {osg}) in [{olo}, {ohi}]; a turn's "
        "prompt is the system prompt, the earlier turns (replies as fixed tokens, the same for "
        "both engines) and its user message, sent when the turn before it is done. Cache hit "
        "rate: cached tokens over context tokens looked up at admission (ours only)."
    ]


def _max_len(cfg: dict) -> int:
    return PeerConfig.from_json(cfg).max_model_len


def _settings_line(name: str, s: dict) -> str:
    keys = {
        OURS: ("max_prefill_tokens", "graphs", "overlap_rounds", "kv_cache_memory"),
        PEER: ("max_num_batched_tokens", "chunked_prefill", "async_scheduling", "cudagraph_mode"),
    }.get(name, ())
    return ", ".join(f"{k} {s[k]}" for k in keys if s.get(k) is not None) or "-"


def write_outputs(record: dict, out: Path, name: str = "peer-vllm") -> list[Path]:
    from loadtests.lab.peer.plots import write_plot

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    paths[0].write_text(json.dumps(record, indent=1))
    paths[1].write_text(markdown(record, name))
    write_plot(record, paths[2])
    return paths


def summary_table(record: dict) -> str:
    """The terminal's short table: decode and chat tokens/s per C, both engines, the ratio."""
    eng = record["engines"]
    rows = ["workload  C      ours tok/s   vLLM tok/s   ratio   roofline"]
    roof = _by_c(record["roofline"])
    for wl, key in (
        ("wave", "decode_tok_s"),
        ("chat", "output_tok_s"),
        ("multiturn", "output_tok_s"),
    ):
        ours, peer = _by_c(eng.get(OURS, {}).get(wl, [])), _by_c(eng.get(PEER, {}).get(wl, []))
        for c in sorted(set(ours) | set(peer)):
            o, p = ours.get(c, {}).get(key), peer.get(c, {}).get(key)
            top = roof.get(c, {}).get("decode_tok_s") if wl == "wave" else None
            rows.append(
                f"{wl:<8}  {c:<5}  {_f(o):>10}   {_f(p):>10}   {_f(_ratio(o, p), 3):>5}   "
                f"{_f(top):>8}"
            )
    return "\n".join(rows)
