"""Figures and greedy samples for docs/demo-model.md, from the shipped pair and its run record.

    python -m hipfire_serve.demo.report --docs docs

Writes `demo-model-target-loss.png` and `demo-model-draft-distill.png` into the docs folder and
prints a Markdown block of greedy samples generated here (CPU, fp32 from the bf16 weights)
with `transformers`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hipfire_serve.demo import demo_draft_dir, demo_model_dir

DEMO_DIR = Path(__file__).resolve().parent
SAMPLE_PROMPTS = (
    ("code", "def fibonacci(n):"),
    ("code", "class Stack:\n    def push(self, item):"),
    ("prose", "To be, or not to be"),
    ("prose", "The Python language"),
)
CHAT_PROMPT = "Explain the Python topic 'assert'."


def plot_target(record: dict, out: Path) -> None:
    log = record["target_log"]
    train, val = log["train"], log["val"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    tokens = [r["tokens"] / 1e6 for r in train]
    ax.plot(tokens, [r["code_loss"] for r in train], lw=0.8, alpha=0.6, label="train, code")
    ax.plot(tokens, [r["prose_loss"] for r in train], lw=0.8, alpha=0.6, label="train, prose")
    vt = [r["tokens"] / 1e6 for r in val]
    ax.plot(vt, [r["code_ce"] for r in val], "o-", ms=3, label="validation, code")
    ax.plot(vt, [r["prose_ce"] for r in val], "s-", ms=3, label="validation, prose")
    best = next(r for r in val if r["step"] == log["best_step"])
    ax.axvline(best["tokens"] / 1e6, color="grey", ls="--", lw=0.8, label="kept checkpoint")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0.8, 6.0)
    ax.set_title(f"demo target ({record['target_params'] / 1e6:.1f} M params), {record['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_draft(record: dict, out: Path) -> None:
    log = record["draft_log"]
    train, val = log["train"], log["val"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    ax1.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], lw=0.8, label="train")
    vt = [r["tokens"] / 1e6 for r in val]
    ax1.plot(vt, [r["code_kl"] for r in val], "o-", ms=3, label="validation, code")
    ax1.plot(vt, [r["prose_kl"] for r in val], "s-", ms=3, label="validation, prose")
    ax1.set_xlabel("training tokens (millions)")
    ax1.set_ylabel("KL(target || draft) (nats/token)")
    ax1.set_ylim(0, 3)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.plot(vt, [r["code_agree"] for r in val], "o-", ms=3, label="code")
    ax2.plot(vt, [r["prose_agree"] for r in val], "s-", ms=3, label="prose")
    ax2.set_xlabel("training tokens (millions)")
    ax2.set_ylabel("top-1 agreement with target")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(f"demo draft ({record['draft_params'] / 1e6:.1f} M params), distilled")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def greedy_samples(max_new_tokens: int = 64) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = []
    for label, model_dir in (("target", demo_model_dir()), ("draft", demo_draft_dir())):
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eos = model.generation_config.eos_token_id
        prompts = [(g, p, tok(p, return_tensors="pt").input_ids) for g, p in SAMPLE_PROMPTS]
        chat_ids = tok.apply_chat_template(
            [{"role": "user", "content": CHAT_PROMPT}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        prompts.append(("chat", CHAT_PROMPT, chat_ids))
        for group, prompt, ids in prompts:
            with torch.no_grad():
                gen = model.generate(
                    ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos
                )
            text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            out.append({"model": label, "group": group, "prompt": prompt, "text": text})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="figures and samples for the demo model docs")
    parser.add_argument("--docs", type=Path, required=True)
    args = parser.parse_args(argv)
    record = json.loads((DEMO_DIR / "training_record.json").read_text())
    plot_target(record, args.docs / "demo-model-target-loss.png")
    plot_draft(record, args.docs / "demo-model-draft-distill.png")
    for s in greedy_samples():
        print(f"**{s['model']}, {s['group']}**, prompt `{s['prompt']!r}`:\n")
        print("```text\n" + s["prompt"] * (s["group"] != "chat") + s["text"] + "\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
