"""Trains the demo pair on one GPU, then measures it (needs torch, numpy and safetensors).

    python3 -m hipfire_serve.demo.train --data .devdata --out OUT_DIR

Reads the token arrays written by `hipfire_serve.demo.corpus`. Writes into OUT_DIR:
`target.part1.safetensors`, `target.part2.safetensors` (the bf16 target, split in two halves of
the tensor list so each file stays small), `draft.safetensors`, and `record.json` (shapes, loss
curves, validation perplexity, acceptance at depth 8, greedy sample token ids).
`hipfire_serve.demo.package` turns these into the shipped model directories.

Target: next-token cross-entropy on a fixed mix of code and prose windows. Draft: distilled
from the trained target (forward KL to the target's next-token distribution at every position).
Both runs are time-budgeted (`train_one`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hipfire_serve.demo.evaluate import (
    greedy_generate,
    measure_acceptance,
    perplexity,
    pick_prompts,
)
from hipfire_serve.demo.model import DRAFT_SHAPE, TARGET_SHAPE, DemoCausalLM, DemoModelConfig

WARMUP_STEPS = 100
DECAY_SHARE = 0.3
SPEC_DEPTH = 8
ACCEPT_PROMPT_LEN = 128


@dataclass(frozen=True)
class Settings:
    """Run sizes; the defaults are the shipped run, the CLI shrinks them for a CPU smoke run."""

    seq_len: int = 2048
    batch_seqs: int = 64  # 131k tokens a step
    prose_seqs: int = 16  # of batch_seqs per step: prose a quarter, code three quarters
    eval_every_s: float = 10.0
    val_eval_seqs: int = 16  # per kind, fixed windows, for the periodic evaluation
    accept_prompts: int = 64  # per kind
    accept_gen: int = 96  # greedy target tokens walked in speculative rounds per prompt
    sample_new_tokens: int = 96
    max_ppl_tokens: int = 0  # validation tokens per kind for the perplexity; 0: all


class Batches:
    """Random training windows [B, seq_len + 1] from device-resident token streams."""

    def __init__(self, code: np.ndarray, prose: np.ndarray, settings: Settings, device, seed):
        self.settings = settings
        self.code = torch.from_numpy(code.astype(np.int64)).to(device)
        self.prose = torch.from_numpy(prose.astype(np.int64)).to(device)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(settings.seq_len + 1, device=device)  # [T + 1]

    def _windows(self, stream: torch.Tensor, num: int) -> torch.Tensor:
        high = stream.numel() - self.settings.seq_len - 1
        starts = torch.randint(0, high, (num,), generator=self.gen, device=stream.device)
        return stream[starts[:, None] + self.offsets]  # [num, T + 1]

    def next(self) -> torch.Tensor:
        s = self.settings
        code = self._windows(self.code, s.batch_seqs - s.prose_seqs)
        prose = self._windows(self.prose, s.prose_seqs)
        return torch.cat([code, prose])  # [B, T + 1]; code rows first


def fixed_windows(tokens: np.ndarray, num: int, seq_len: int, device) -> torch.Tensor:
    stride = (len(tokens) - seq_len - 1) // num
    rows = [tokens[i * stride : i * stride + seq_len + 1] for i in range(num)]
    return torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)  # [num, T + 1]


def lr_at(step: int, progress: float, peak: float) -> float:
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    decay = 1.0 if progress < 1 - DECAY_SHARE else max(0.02, (1 - progress) / DECAY_SHARE)
    return peak * warm * decay


def make_optimizer(model: torch.nn.Module, lr: float, device) -> torch.optim.Optimizer:
    # No weight decay on norms (1-D); decay on matrices and the tied embedding.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), fp32. [.., V] each."""
    s_logp = F.log_softmax(student_logits.float(), dim=-1)
    t_logp = F.log_softmax(teacher_logits.float(), dim=-1)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


@torch.no_grad()
def val_losses(model, val: dict[str, torch.Tensor], teacher=None) -> dict[str, float]:
    """Per kind: CE on the data; with a teacher also KL(teacher || model) and top-1 agreement."""
    model.eval()
    out = {}
    for kind, windows in val.items():
        ce, kl, agree = [], [], []
        for chunk in windows.split(8):
            with torch.autocast(chunk.device.type, dtype=torch.bfloat16):
                logits = model(chunk[:, :-1]).float()  # [b, T, V]
                ce.append(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
                if teacher is not None:
                    t_logits = teacher(chunk[:, :-1]).float()
                    kl.append(kl_loss(logits, t_logits).item())
                    agree.append((logits.argmax(-1) == t_logits.argmax(-1)).float().mean().item())
        out[f"{kind}_ce"] = float(np.mean(ce))
        if teacher is not None:
            out[f"{kind}_kl"] = float(np.mean(kl))
            out[f"{kind}_agree"] = float(np.mean(agree))
    model.train()
    return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_one(
    name: str,
    model: DemoCausalLM,
    batches: Batches,
    val: dict[str, torch.Tensor],
    budget_s: float,
    peak_lr: float,
    teacher: DemoCausalLM | None = None,
) -> tuple[DemoCausalLM, dict]:
    """Time-budgeted training; returns the best checkpoint (by validation) and its log.

    The LR schedule (linear warmup, constant, linear decay over the last `DECAY_SHARE` of the
    budget) follows elapsed time, and the checkpoint kept is the one with the best validation
    score seen at the periodic evaluations: the corpus is small, so many epochs pass and the
    prose can be over-fitted late in a run.

    With a `teacher` the loss is KL(teacher || model): greedy speculation accepts a draft token
    exactly when it equals the target's argmax, so a draft that imitates the target's
    distribution is what raises acceptance; plain corpus training would spend the draft's small
    capacity on the data's own noise instead.
    """
    settings = batches.settings
    device = batches.code.device
    opt = make_optimizer(model, peak_lr, device)
    log: dict = {"name": name, "peak_lr": peak_lr, "budget_s": budget_s, "train": [], "val": []}
    best_score, best_state, best_step = -math.inf, None, -1
    step, tokens_seen = 0, 0
    num_code = settings.batch_seqs - settings.prose_seqs
    _sync(device)
    t0 = time.perf_counter()
    last_eval = t0
    while True:
        lr = lr_at(step, (time.perf_counter() - t0) / budget_s, peak_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batches.next()  # [B, T + 1]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)  # [B, T, V]
            if teacher is None:
                per_tok = F.cross_entropy(
                    logits.float().flatten(0, 1), labels.flatten(), reduction="none"
                ).view(labels.shape)  # [B, T]
                loss = per_tok.mean()
            else:
                with torch.no_grad():
                    t_logits = teacher(inputs)  # [B, T, V]
                loss = kl_loss(logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += labels.numel()
        if step % 25 == 0:
            row = {
                "step": step,
                "time_s": round(time.perf_counter() - t0, 2),
                "tokens": tokens_seen,
                "lr": lr,
                "loss": loss.item(),
                "grad_norm": grad_norm.item(),
            }
            if teacher is None:
                row["code_loss"] = per_tok[:num_code].mean().item()
                row["prose_loss"] = per_tok[num_code:].mean().item()
            log["train"].append(row)
        now = time.perf_counter()
        finished = now - t0 >= budget_s
        if now - last_eval >= settings.eval_every_s or finished:
            last_eval = now
            v = val_losses(model, val, teacher)
            # Target: lowest mean CE of the two kinds. Draft: highest mean top-1 agreement with
            # the target, the quantity greedy acceptance depends on.
            if teacher is None:
                score = -(v["code_ce"] + v["prose_ce"]) / 2
            else:
                score = (v["code_agree"] + v["prose_agree"]) / 2
            v.update(step=step, time_s=round(now - t0, 2), tokens=tokens_seen, score=score)
            log["val"].append(v)
            shown = {k: round(x, 4) for k, x in v.items() if k.endswith(("ce", "agree"))}
            print(
                f"[{name}] step {step} t={now - t0:.0f}s lr={lr:.2e} "
                f"loss={loss.item():.3f} val={shown}",
                flush=True,
            )
            if score > best_score:
                best_score, best_state, best_step = score, copy.deepcopy(model.state_dict()), step
        if finished:
            break
    wall_s = time.perf_counter() - t0
    log.update(
        steps=step,
        tokens=tokens_seen,
        wall_s=round(wall_s, 2),
        best_step=best_step,
        tokens_per_s=round(tokens_seen / wall_s),
    )
    model.load_state_dict(best_state)
    return model, log


def save_halves(state: dict[str, torch.Tensor], out_dir: Path, stem: str) -> None:
    """Two files of about equal size (the transfer back limits each file's size)."""
    names = list(state)
    sizes = np.cumsum([state[n].numel() for n in names])
    cut = int(np.searchsorted(sizes, sizes[-1] / 2)) + 1
    for k, part in enumerate((names[:cut], names[cut:]), start=1):
        save_file(
            {n: state[n] for n in part},
            str(out_dir / f"{stem}.part{k}.safetensors"),
            metadata={"format": "pt"},
        )


@torch.no_grad()
def measure(target, draft, arrays, prompt_sets, settings: Settings, special, device, seed):
    """Perplexity, acceptance at depth 8 and greedy samples, all in fp32 from bf16 weights."""
    eot_id, im_end_id = special["<|endoftext|>"], special["<|im_end|>"]
    target_f32, draft_f32 = copy.deepcopy(target).float(), copy.deepcopy(draft).float()
    # Round-trip through bf16 so the numbers are those of the shipped weights.
    for m_f32, m in ((target_f32, target), (draft_f32, draft)):
        m_f32.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in m.state_dict().items()})
    evals: dict = {"perplexity": {}, "acceptance": {}}
    for kind in ("code", "prose"):
        for label, m in (("target", target_f32), ("draft", draft_f32)):
            tokens = arrays[f"{kind}_val"]
            if settings.max_ppl_tokens:
                tokens = tokens[: settings.max_ppl_tokens + 1]
            ppl, count = perplexity(m, tokens, settings.seq_len, 16, device)
            evals["perplexity"][f"{label}_{kind}"] = {"ppl": ppl, "num_tokens": count}
        prompts = pick_prompts(
            arrays[f"{kind}_val"],
            settings.accept_prompts,
            ACCEPT_PROMPT_LEN,
            settings.accept_gen + SPEC_DEPTH,
            seed,
            eot_id,
        )
        evals["acceptance"][kind] = measure_acceptance(
            target_f32,
            draft_f32,
            torch.from_numpy(prompts).to(device),
            settings.accept_gen,
            SPEC_DEPTH,
        )
        print(kind, json.dumps(evals["acceptance"][kind]), flush=True)
    samples = []
    for group, items in prompt_sets.items():
        for item in items:
            ids = torch.tensor([item["ids"]], device=device)
            for label, m in (("target", target_f32), ("draft", draft_f32)):
                gen = greedy_generate(
                    m, ids, settings.sample_new_tokens, stop_ids=(eot_id, im_end_id)
                )
                samples.append(
                    {"group": group, "prompt": item["text"], "model": label, "ids": gen[0].tolist()}
                )
    return evals, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train the demo target and draft on one GPU")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target-seconds", type=float, default=150.0)
    parser.add_argument("--draft-seconds", type=float, default=75.0)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    manifest = json.loads((args.data / "manifest.json").read_text())
    vocab_size = manifest["vocab_size"]
    special = manifest["special_token_ids"]
    arrays = {
        f"{kind}_{split}": np.load(args.data / f"{kind}_{split}.npy")
        for kind in ("code", "prose")
        for split in ("train", "val")
    }
    batches = Batches(arrays["code_train"], arrays["prose_train"], settings, device, args.seed)
    val = {
        k: fixed_windows(arrays[f"{k}_val"], settings.val_eval_seqs, settings.seq_len, device)
        for k in ("code", "prose")
    }
    # The config's context length is the training window: RoPE positions past it were never
    # seen, and the server takes its context limit from here.
    target_cfg = DemoModelConfig(
        vocab_size=vocab_size, max_position_embeddings=settings.seq_len, **TARGET_SHAPE
    )
    draft_cfg = DemoModelConfig(
        vocab_size=vocab_size, max_position_embeddings=settings.seq_len, **DRAFT_SHAPE
    )
    target = DemoCausalLM(target_cfg).to(device)
    print(f"target params {target.num_params():,}", flush=True)
    target, target_log = train_one(
        "target", target, batches, val, args.target_seconds, args.target_lr
    )
    target.eval().requires_grad_(False)
    draft = DemoCausalLM(draft_cfg).to(device)
    print(f"draft params {draft.num_params():,}", flush=True)
    draft, draft_log = train_one(
        "draft", draft, batches, val, args.draft_seconds, args.draft_lr, teacher=target
    )
    draft.eval().requires_grad_(False)
    train_wall_s = time.perf_counter() - t_start
    save_halves(target.hf_state_dict(), args.out, "target")
    save_file(draft.hf_state_dict(), str(args.out / "draft.safetensors"), metadata={"format": "pt"})

    record = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "settings": asdict(settings),
        "target_config": target_cfg.as_dict(),
        "draft_config": draft_cfg.as_dict(),
        "target_params": target.num_params(),
        "draft_params": draft.num_params(),
        "target_log": target_log,
        "draft_log": draft_log,
        "train_wall_s": round(train_wall_s, 2),
    }
    # Written before the measurements too, so a failure there still leaves the training record.
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")

    torch.backends.cuda.matmul.allow_tf32 = False  # greedy choices should not hinge on TF32
    t_eval = time.perf_counter()
    prompt_sets = json.loads((args.data / "prompts.json").read_text())
    evals, samples = measure(
        target, draft, arrays, prompt_sets, settings, special, device, args.seed
    )
    evals["eval_wall_s"] = round(time.perf_counter() - t_eval, 2)
    record.update(eval=evals, samples=samples)
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(evals["perplexity"]), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
