"""Draft acceptance of the two exact verification rules for sampled drafts, on a real pair:
rejection sampling (accepts a draft with probability 1 - TV(p, q)) against Gumbel-max coupling
(the draft drawn with the target's own noise, accepted when the two draws agree: what a request
with its own seed gets, `executor/accept.py`).

    hipfire-bench coupling [--temperatures 0.7 1.0] [--prompts 12] [--new-tokens 96]

The target samples a continuation of every prompt of the code and prose cohorts (plain
decoding, seeded); both models then score the whole text in one forward each, and at every
position the acceptance of each rule is computed exactly from p and q (no sampling): for the
coupling, P(argmax p/E = argmax q/E) = sum_v 1 / sum_u max(p_u / p_v, q_u / q_v) over
independent Exp(1) noise E, summed over the tokens holding the mass (the rest bounds the error).
Tokens per round at depth D follow from the per-position acceptances along the text. Writes a
table and `docs/perf/coupled-drafts.md` + `.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from executor.kv_cache import KVCache
from executor.loader import load_model
from executor.model import AttnMetadata, Model
from hipfire_serve.demo import demo_draft_dir, demo_model_dir
from loadtests.prompts import load_cohort

# Tokens per position whose coupling terms are summed: they hold all but a sliver of p + q.
TOP_TOKENS = 256
DEPTHS = (4, 8)


def score(model: Model, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] float32 of one sequence, one forward over a fresh cache."""
    n, page = len(tokens), 16
    num_blocks = -(-n // page)
    kv = KVCache.for_model(model, num_blocks=num_blocks, block_size=page)
    meta = AttnMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
    )
    return model.logits(model.forward(torch.tensor(tokens), meta, kv.k, kv.v))


def acceptances(
    p: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p, q [n, V] distributions -> (rejection sampling [n], coupling [n], the coupling's
    truncation bound [n]: the mass of min(p, q) outside the summed tokens, each of which adds
    at most its min(p_v, q_v), so the exact coupling lies in [coupling, coupling + bound])."""
    rejection = torch.minimum(p, q).sum(-1)  # [n]
    top = (p + q).topk(min(TOP_TOKENS, p.shape[-1]), dim=-1).indices  # [n, T]
    p_v, q_v = p.gather(1, top), q.gather(1, top)  # [n, T]
    tiny = torch.finfo(p.dtype).tiny
    # sum_u max(p_u / p_v, q_u / q_v) for every summed v: [n, T], a few positions at a time
    ratio = torch.cat(
        [
            torch.maximum(
                p[a : a + 8, None, :] / p_v[a : a + 8, :, None].clamp_min(tiny),
                q[a : a + 8, None, :] / q_v[a : a + 8, :, None].clamp_min(tiny),
            ).sum(-1)
            for a in range(0, p.shape[0], 8)
        ]
    )
    coupling = (1.0 / ratio).sum(-1)  # [n]
    outside = torch.minimum(p, q).sum(-1) - torch.minimum(p_v, q_v).sum(-1)
    return rejection, coupling, outside.clamp_min(0.0)


def tokens_per_round(accept: torch.Tensor, depth: int) -> float:
    """Mean over start positions of 1 + a_1 + a_1 a_2 + ... (depth - 1 drafts) along the text."""
    n = accept.shape[0] - depth + 1
    if n <= 0:
        return float("nan")
    total = torch.ones(n, dtype=torch.float64)
    run = torch.ones(n, dtype=torch.float64)
    for k in range(depth - 1):
        run = run * accept[k : k + n].double()
        total += run
    return float(total.mean())


def measure(args) -> dict:
    from hipfire_serve import LLM, SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    llm = LLM("demo", draft="none", device="cpu", dtype="float32")
    tok = llm.engine.tokenizer
    target = load_model(demo_model_dir(), dtype="float32")
    draft = load_model(demo_draft_dir(), dtype="float32")
    results = {}
    for cohort in ("code", "prose"):
        prompts = load_cohort(cohort)[: args.prompts]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": pr.prompt}], add_generation_prompt=True
            )
            for pr in prompts
        ]
        for temp in args.temperatures:
            params = [
                SamplingParams(
                    max_tokens=args.new_tokens, temperature=temp, seed=100 + i, ignore_eos=True
                )
                for i in range(len(texts))
            ]
            outs = llm.generate(texts, params)
            rej_all, cpl_all, bound_all, rows = [], [], [], []
            for text, out in zip(texts, outs):
                ids = tok.encode(text, add_special_tokens=False) + list(out.outputs[0].token_ids)
                start = len(ids) - len(out.outputs[0].token_ids)
                p = torch.softmax(score(target, ids)[start - 1 : -1] / temp, dim=-1)
                q = torch.softmax(score(draft, ids)[start - 1 : -1] / temp, dim=-1)
                rej, cpl, bound = acceptances(p.double(), q.double())
                bound_all.append(bound)
                rej_all.append(rej)
                cpl_all.append(cpl)
                rows.append(
                    {d: (tokens_per_round(rej, d), tokens_per_round(cpl, d)) for d in DEPTHS}
                )
            rej_cat, cpl_cat = torch.cat(rej_all), torch.cat(cpl_all)
            per_depth = {
                str(d): {
                    "rejection": sum(r[d][0] for r in rows) / len(rows),
                    "coupling": sum(r[d][1] for r in rows) / len(rows),
                }
                for d in DEPTHS
            }
            results[f"{cohort}@{temp}"] = {
                "cohort": cohort,
                "temperature": temp,
                "positions": int(rej_cat.numel()),
                "accept_rejection": float(rej_cat.mean()),
                "accept_coupling": float(cpl_cat.mean()),
                "coupling_bound_mean": float(torch.cat(bound_all).mean()),
                "tokens_per_round": per_depth,
            }
    return results


def render(results: dict, meta: dict) -> str:
    lines = [
        "# Sampled drafts: rejection sampling vs coupling to the target's draws",
        "",
        f"Measured {meta['date']} on {meta['machine']} (CPU), commit {meta['commit']}, with "
        "`hipfire-bench coupling`: the demo target and its chain draft model "
        f"({meta['prompts']} prompts per cohort, {meta['new_tokens']} sampled tokens each, "
        "acceptances computed exactly from p and q at every position of the target's own text).",
        "",
        "A request with its own `seed` is verified by coupling (its output is then plain "
        "decoding's with that seed, whatever the route); one without keeps rejection sampling.",
        "",
        "| cohort | T | positions | accept / draft, rejection | coupling | ratio | tokens/round "
        "D=8, rejection | coupling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        tpr = r["tokens_per_round"]["8"]
        lines.append(
            f"| {r['cohort']} | {r['temperature']} | {r['positions']} | "
            f"{r['accept_rejection']:.3f} | {r['accept_coupling']:.3f} | "
            f"{r['accept_coupling'] / r['accept_rejection']:.3f} | {tpr['rejection']:.2f} | "
            f"{tpr['coupling']:.2f} |"
        )
    worst = max(r["coupling_bound_mean"] for r in results.values())
    lines += [
        "",
        f"Coupling figures sum the {TOP_TOKENS} tokens of largest p + q per position, a lower "
        "bound: the tokens left out add at most their min(p, q), on average at most "
        f"{worst:.3f} per position in the worst row.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hipfire-bench coupling", description=__doc__)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--docs", default="docs/perf")
    args = parser.parse_args(argv)
    import subprocess

    t0 = time.perf_counter()
    results = measure(args)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine() + " " + platform.processor(),
        "commit": commit or "unknown",
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = render(results, meta)
    print(text)
    out = Path(args.docs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coupled-drafts.md").write_text(text)
    (out / "coupled-drafts.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
