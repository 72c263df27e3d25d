"""`hipfire-bench quant-agreement`: greedy agreement of a quantized model with its bf16 self.

    hipfire-bench quant-agreement --out OUT                 # the demo target, 20 prompts x 64
    hipfire-bench quant-agreement --out OUT --prompts 2 --tokens 8
The model (default: the embedded demo target) is loaded in bf16 and encoded in memory into the
FP8 (128 x 128 block scales) and W4A16 (GPTQ, group 128, symmetric) layouts, read back by the
loader (`quant_layouts.quantized_model`); each decodes the same prompts greedily (the first
prompts of a load-test cohort, as the demo tokenizer encodes them, no chat template), and its
tokens are compared position by position with bf16's. Writes quant-agreement.md and .json."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from loadtests.lab.quant_layouts import Layout, quantized_model
from loadtests.lab.quant_record import agreement

PROG = "hipfire-bench quant-agreement"
BLOCK = 16  # KV block size of the decode below
LAYOUTS = {"fp8": Layout("fp8"), "w4a16": Layout("gptq", group_size=128)}


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """One sequence decoded greedily through `Model.forward` on its own paged cache: the prompt
    in one prefill, then one row per token."""
    from executor.kv_cache import KVCache
    from executor.model import AttnMetadata

    dev = model.device
    blocks = -(-(len(prompt) + num_tokens) // BLOCK)
    kv = KVCache.for_model(model, num_blocks=blocks, block_size=BLOCK)
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]

    def last_logits(tokens: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(tokens), device=dev)
        meta = AttnMetadata(
            positions=pos,
            slot_mapping=pos,  # blocks 0.. in order: slot = position
            cu_q_lens=torch.tensor([0, len(tokens)], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([start + len(tokens)], dtype=torch.int32, device=dev),
            block_tables=table,
        )
        hidden = model.forward(torch.tensor(tokens, device=dev), meta, kv.k, kv.v)
        return model.logits(hidden[-1:])[0]

    out: list[int] = []
    logits = last_logits(prompt, 0)
    for i in range(num_tokens):
        out.append(int(logits.argmax()))
        if i + 1 < num_tokens:
            logits = last_logits(out[-1:], len(prompt) + i)
    return out


def cohort_prompts(cohort: Path, tokenizer: Path, count: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    lines = [json.loads(line) for line in cohort.read_text().splitlines() if line.strip()]
    if len(lines) < count:
        raise ValueError(f"--prompts: {cohort.name} holds {len(lines)} prompts, not {count}")
    return [tok.encode(line["prompt"]).ids for line in lines[:count]]


def measure(model_dir: Path, cohort: Path, prompts: int, tokens: int, label: str) -> dict:
    from executor.loader import load_model

    t0 = time.time()
    base = load_model(model_dir, dtype="bfloat16", device="cpu")
    ids = cohort_prompts(cohort, model_dir / "tokenizer.json", prompts)
    base_tokens = [greedy(base, p, tokens) for p in ids]
    formats = {}
    for name, layout in LAYOUTS.items():
        model = quantized_model(base, layout)
        got = [greedy(model, p, tokens) for p in ids]
        first = sum(a[0] == b[0] for a, b in zip(base_tokens, got)) / len(ids)
        formats[name] = {
            "layout": layout.config(),
            "agreement": agreement(base_tokens, got),
            "first_token_match": first,
            "tokens": got,
        }
    return {
        "benchmark": "quant-agreement",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": label,
        "cohort": cohort.name,
        "prompts": prompts,
        "tokens": tokens,
        "prompt_tokens": [len(p) for p in ids],
        "device": "cpu",
        "torch": torch.__version__,
        "elapsed_s": round(time.time() - t0, 1),
        "bf16_tokens": base_tokens,
        "formats": formats,
    }


def markdown(rec: dict) -> str:
    lines = [
        f"# Greedy agreement of quantized weights with bf16: {rec['model']}",
        "",
        f"By `{PROG}` on {rec['date']}, {rec['device']}, torch {rec['torch']}, "
        f"{rec['elapsed_s']:.0f} s (JSON: `quant-agreement.json`). The model in bf16 and encoded "
        "in memory into each layout (read back by the loader; on a CPU FP8 weights are "
        "dequantized at load and int4 products run the torch reference), "
        f"{rec['prompts']} prompts of `{rec['cohort']}` ({min(rec['prompt_tokens'])}-"
        f"{max(rec['prompt_tokens'])} tokens) x {rec['tokens']} greedy tokens.",
        "",
        "| format | layout | positions equal | first token equal | mean common prefix | "
        "prompts identical |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, f in rec["formats"].items():
        a = f["agreement"]
        lines.append(
            f"| {name} | `{json.dumps(f['layout'], separators=(',', ':'))}` | "
            f"{a['position_match']:.1%} | {f['first_token_match']:.0%} | "
            f"{a['mean_common_prefix']:.1f} of {rec['tokens']} | "
            f"{a['identical_prompts']}/{a['prompts']} |"
        )
    lines += [
        "",
        "Positions after the first difference compare continuations of different texts, so "
        "*positions equal* undercounts the agreement of the distributions; the common prefix "
        "is the stricter figure.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from hipfire_serve.demo import demo_model_dir

    cohorts = Path(__file__).resolve().parents[1] / "cohorts"
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for quant-agreement.md and .json")
    ap.add_argument("--model", default=str(demo_model_dir()), help="a dense HF model directory")
    ap.add_argument("--cohort", default=str(cohorts / "mixed.jsonl"), help="prompts (JSONL)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        ap.error("--prompts and --tokens: at least 1")
    model_dir, cohort = Path(args.model), Path(args.cohort)
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        ap.error(f"--model: {model_dir} holds no config.json and tokenizer.json")
    if not cohort.is_file():
        ap.error(f"--cohort: no file {cohort}")
    try:
        label = "the demo target" if model_dir == demo_model_dir() else model_dir.name
        rec = measure(model_dir, cohort, args.prompts, args.tokens, label)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant-agreement.json").write_text(json.dumps(rec, indent=1))
    text = markdown(rec)
    (out / "quant-agreement.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
