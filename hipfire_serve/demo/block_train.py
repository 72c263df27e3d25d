"""Trains a block drafter (DFlash layout) for the demo target, then measures its acceptance.

    python -m hipfire_serve.demo.block_train --data .devdata \\
        --target hipfire_serve/demo/models/target --out OUT_DIR [--seconds S] [--small]

The target is frozen. Training sequences are the target's own greedy continuations of corpus
prompts (code and prose kept apart, prose a quarter of every batch, as in `train`): a block
drafter serves greedy verification, which accepts a draft exactly when it is the target's
argmax after the *verified* tokens, so its labels should be conditioned on what the target
itself writes. Per step: one target forward gives the chosen layers' states and its next-token
distributions; anchors are sampled (mostly in the generated part, where serving anchors
blocks) and all blocks of a sequence run in one masked pass; the loss is KL(target || drafter)
at block rows 1..B-1, row k weighted exp(-(k - 1) / gamma), since a draft counts only when
all before it were accepted. Time-budgeted; the checkpoint kept is the one with the best
validation acceptance. Writes OUT_DIR/{config.json, model.safetensors, record.json}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hipfire_serve.demo import demo_draft_dir
from hipfire_serve.demo.block_drafter import (
    BlockDrafterShape,
    DemoBlockDrafter,
    load_trainable_block_drafter,
    save_block_drafter,
    target_states,
)
from hipfire_serve.demo.block_evaluate import load_demo_model, measure_block_acceptance
from hipfire_serve.demo.evaluate import pick_prompts
from hipfire_serve.demo.model import DemoCausalLM, apply_rope, rope_cos_sin
from hipfire_serve.demo.tokenizer import END_OF_TEXT, IM_START
from hipfire_serve.demo.train import ACCEPT_PROMPT_LEN, SPEC_DEPTH, make_optimizer

# The mask token fills the B - 1 rows to draft; its (frozen) embedding is the only thing that
# marks them. `<|im_start|>` is used: a special token, so no text token's embedding is taken,
# and it never ends a verified context inside a document (a chat prompt ends with the role
# line after it), so row 0 and the mask rows rarely carry one token. `<|endoftext|>` is the
# pad and document separator that contexts hold and generation stops on.
MASK_TOKEN = IM_START


@dataclass(frozen=True)
class Settings:
    """Run sizes; the defaults are the shipped run, `--small` a CPU smoke run."""

    seq_len: int = 512  # tokens per training sequence: corpus prompt + greedy continuation
    min_prompt_len: int = 64  # corpus prompt length, drawn per generation batch
    max_prompt_len: int = 256
    pool_seqs: int = 49152  # training sequences generated before training
    gen_batch: int = 4096
    val_seqs: int = 64  # per kind: validation sequences (prompts from the val split)
    batch_seqs: int = 64
    prose_seqs: int = 16  # of batch_seqs per step
    anchors_per_seq: int = 32  # blocks per sequence and step
    prompt_anchor_share: float = 0.25  # anchors drawn anywhere, the rest in the generated part
    block_size: int = 16
    num_layers: int = 2
    intermediate_size: int = 896
    num_feature_layers: int = 3  # target layers read, spread over its depth
    gamma: float = 7.0  # position weight exp(-(k - 1) / gamma)
    peak_lr: float = 3e-3
    warmup_steps: int = 100
    decay_share: float = 0.3  # linear LR decay over the last share of the budget
    eval_every_s: float = 10.0
    accept_prompts: int = 64  # per kind
    accept_gen: int = 96
    accept_prompt_len: int = ACCEPT_PROMPT_LEN


SMALL = dict(
    seq_len=64,
    min_prompt_len=16,
    max_prompt_len=32,
    pool_seqs=24,
    gen_batch=12,
    val_seqs=4,
    batch_seqs=8,
    prose_seqs=2,
    anchors_per_seq=4,
    block_size=4,
    num_layers=1,
    intermediate_size=64,
    peak_lr=3e-3,
    warmup_steps=3,
    eval_every_s=1.0,
    accept_prompts=2,
    accept_gen=8,
    accept_prompt_len=16,
)


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers evenly spaced and ending at the last: 6 layers, 3 -> (1, 3, 5)."""
    count = min(count, num_target_layers)
    step = num_target_layers // count
    return tuple(num_target_layers - 1 - step * (count - 1 - j) for j in range(count))


def _autocast(device: torch.device):
    # bf16 on the GPU (as `train`); the CPU runs fp32, where bf16 matmuls are slow.
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def greedy_continue(target: DemoCausalLM, prompts: torch.Tensor, num_new: int) -> torch.Tensor:
    """prompts [n, P] -> the target's greedy continuation [n, num_new], with a KV cache."""
    cfg = target.cfg
    num, prompt_len = prompts.shape
    total = prompt_len + num_new
    cos, sin = rope_cos_sin(total, cfg.head_dim, cfg.rope_theta, prompts.device)  # [T, D]
    x = target.model.embed_tokens(prompts)  # [n, P, hidden]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    caches = []
    out = []
    for step in range(num_new):
        start = 0 if step == 0 else prompt_len + step - 1
        end = prompt_len + step
        if step:
            x = target.model.embed_tokens(out[-1][:, None])  # [n, 1, hidden]
        for i, layer in enumerate(target.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            rows = h.shape[1]
            q = attn.q_proj(h).view(num, rows, cfg.num_heads, cfg.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(num, rows, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(num, rows, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            q = apply_rope(q, cos[start:end], sin[start:end])
            k = apply_rope(k, cos[start:end], sin[start:end])
            if step == 0:
                shape = (num, cfg.num_kv_heads, total, cfg.head_dim)
                caches.append((k.new_empty(shape), v.new_empty(shape)))
            k_cache, v_cache = caches[i]
            k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
            o = F.scaled_dot_product_attention(
                q, k_cache[:, :, :end], v_cache[:, :, :end], is_causal=step == 0, enable_gqa=True
            )  # [n, Hq, rows, D]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(num, rows, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = target.model.norm(x[:, -1])  # [n, hidden]
        out.append(F.linear(last, target.model.embed_tokens.weight).argmax(-1))
    return torch.stack(out, dim=1)


def generate_pool(
    target: DemoCausalLM, stream: torch.Tensor, num_seqs: int, s: Settings, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_seqs` sequences [seq_len] of a random corpus prompt (length drawn per batch, a
    multiple of 16 where the range allows) and the target's greedy continuation; returns
    (seqs [num_seqs, seq_len] int64, prompt_lens [num_seqs] int64)."""
    seqs, lens = [], []
    device = stream.device
    lengths = list(range(s.min_prompt_len, s.max_prompt_len + 1, 16)) or [s.min_prompt_len]
    while sum(len(x) for x in seqs) < num_seqs:
        num = min(s.gen_batch, num_seqs - sum(len(x) for x in seqs))
        prompt_len = lengths[int(torch.randint(len(lengths), (1,), generator=gen))]
        high = stream.numel() - prompt_len
        starts = torch.randint(0, high, (num,), generator=gen).to(device)
        prompts = stream[starts[:, None] + torch.arange(prompt_len, device=device)]
        with _autocast(device):
            cont = greedy_continue(target, prompts, s.seq_len - prompt_len)
        seqs.append(torch.cat([prompts, cont], dim=1))
        lens.append(torch.full((num,), prompt_len, dtype=torch.long, device=device))
    return torch.cat(seqs), torch.cat(lens)


def sample_anchors(prompt_lens: torch.Tensor, s: Settings, gen: torch.Generator) -> torch.Tensor:
    """[N] -> anchors [N, K]: a share anywhere in [1, T - B], the rest in [P - 1, T - B]
    (row 0 the last prompt token or a generated one, as serving anchors blocks)."""
    num, last = prompt_lens.shape[0], s.seq_len - s.block_size
    u = torch.rand(num, s.anchors_per_seq, generator=gen).to(prompt_lens.device)
    anywhere = torch.rand(num, s.anchors_per_seq, generator=gen).to(prompt_lens.device)
    low = torch.where(anywhere < s.prompt_anchor_share, 1, prompt_lens[:, None] - 1)  # [N, K]
    return low + (u * (last - low + 1)).long().clamp(max=last - low)


def position_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def block_loss(
    drafter: DemoBlockDrafter,
    target: DemoCausalLM,
    seqs: torch.Tensor,
    anchors: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs [N, T], anchors [N, K] -> (weighted KL loss, accepted drafts per block [N, K]:
    the leading rows whose argmax is the target's)."""
    block_size = drafter.shape.block_size
    with torch.no_grad():
        hidden, final = target_states(target, seqs, drafter.shape.target_layer_ids)
        # Row k of a block at a predicts the token at a + k: the target's logits at a + k - 1.
        pos = anchors[:, :, None] + torch.arange(block_size - 1, device=seqs.device)
        rows = final.gather(1, pos.flatten(1)[:, :, None].expand(-1, -1, final.shape[-1]))
        t_logits = drafter.logits(rows).view(*pos.shape, -1).float()  # [N, K, B-1, V]
    block = drafter(hidden, seqs, anchors)  # [N, K, B, hidden]
    s_logits = drafter.logits(block[:, :, 1:]).float()  # [N, K, B-1, V]
    t_logp = F.log_softmax(t_logits, dim=-1)
    kl = (t_logp.exp() * (t_logp - F.log_softmax(s_logits, dim=-1))).sum(-1)  # [N, K, B-1]
    loss = (kl * weights).sum(-1).mean() / weights.sum()
    match = s_logits.argmax(-1) == t_logits.argmax(-1)
    return loss, match.long().cumprod(-1).sum(-1)


@torch.no_grad()
def val_scores(drafter, target, val: dict, s: Settings) -> dict[str, float]:
    """Per kind: the loss and the mean tokens per block (accepted drafts + 1) of blocks
    anchored every 4th position from the last prompt token on, in the generated part, where
    the target's argmax is the next token: the acceptance of greedy verification."""
    drafter.eval()
    out = {}
    weights = position_weights(s.block_size, s.gamma, next(drafter.parameters()).device)
    for kind, (seqs, prompt_lens) in val.items():
        prompt_len = int(prompt_lens[0])
        last = s.seq_len - s.block_size
        anchors = torch.arange(prompt_len - 1, last + 1, 4, device=seqs.device)
        losses, accepted = [], []
        for rows in seqs.split(8):
            with _autocast(seqs.device):
                loss, acc = block_loss(
                    drafter, target, rows, anchors.expand(rows.shape[0], -1), weights
                )
            losses.append(loss.item())
            accepted.append(acc.float().mean().item())
        out[f"{kind}_loss"] = float(np.mean(losses))
        out[f"{kind}_accept_len"] = 1 + float(np.mean(accepted))
    drafter.train()
    return out


def lr_at(step: int, progress: float, s: Settings) -> float:
    warm = min(1.0, (step + 1) / s.warmup_steps)
    decay = 1.0 if progress < 1 - s.decay_share else max(0.02, (1 - progress) / s.decay_share)
    return s.peak_lr * warm * decay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(
    drafter: DemoBlockDrafter,
    target: DemoCausalLM,
    pools: dict,
    val: dict,
    s: Settings,
    budget_s: float,
    gen: torch.Generator,
) -> tuple[DemoBlockDrafter, dict]:
    """Time-budgeted training (LR follows elapsed time); keeps the best validation state."""
    device = pools["code"][0].device
    opt = make_optimizer(drafter, s.peak_lr, device)
    weights = position_weights(s.block_size, s.gamma, device)
    num_code = s.batch_seqs - s.prose_seqs
    log: dict = {"budget_s": budget_s, "train": [], "val": []}
    best_score, best_state, best_step = -math.inf, None, -1
    step = 0
    _sync(device)
    t0 = last_eval = time.perf_counter()
    while True:
        lr = lr_at(step, (time.perf_counter() - t0) / budget_s, s)
        for group in opt.param_groups:
            group["lr"] = lr
        picked = []
        for kind, num in (("code", num_code), ("prose", s.prose_seqs)):
            seqs, lens = pools[kind]
            idx = torch.randint(0, seqs.shape[0], (num,), generator=gen).to(device)
            picked.append((seqs[idx], lens[idx]))
        seqs = torch.cat([p[0] for p in picked])  # [N, T]; code rows first
        anchors = sample_anchors(torch.cat([p[1] for p in picked]), s, gen)  # [N, K]
        with _autocast(device):
            loss, accepted = block_loss(drafter, target, seqs, anchors, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step <= 5:
            log["train"].append(
                {
                    "step": step,
                    "time_s": round(time.perf_counter() - t0, 2),
                    "lr": lr,
                    "loss": loss.item(),
                    "grad_norm": grad_norm.item(),
                    "code_accept_len": 1 + accepted[:num_code].float().mean().item(),
                    "prose_accept_len": 1 + accepted[num_code:].float().mean().item(),
                }
            )
        now = time.perf_counter()
        finished = now - t0 >= budget_s
        if now - last_eval >= s.eval_every_s or finished:
            last_eval = now
            v = val_scores(drafter, target, val, s)
            score = (v["code_accept_len"] + v["prose_accept_len"]) / 2
            v.update(step=step, time_s=round(now - t0, 2), score=score)
            log["val"].append(v)
            shown = {k: round(x, 3) for k, x in v.items() if k.endswith(("loss", "len"))}
            print(f"[block] step {step} t={now - t0:.0f}s lr={lr:.2e} val={shown}", flush=True)
            if score > best_score:
                best_score, best_step = score, step
                best_state = copy.deepcopy(drafter.state_dict())
        if finished:
            break
    wall_s = time.perf_counter() - t0
    log.update(steps=step, wall_s=round(wall_s, 2), best_step=best_step, best_score=best_score)
    drafter.load_state_dict(best_state)
    return drafter, log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train a block drafter for the demo target")
    parser.add_argument("--data", type=Path, required=True, help="corpus folder")
    parser.add_argument("--target", type=Path, required=True, help="target model directory")
    parser.add_argument("--draft", type=Path, default=demo_draft_dir(), help="chain draft dir")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=None, help="training budget")
    parser.add_argument("--small", action="store_true", help="tiny CPU configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    small = "--small" in (sys.argv[1:] if argv is None else argv)
    base = replace(Settings(), **SMALL) if small else Settings()
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(base, f.name)
        parser.add_argument(flag, type=type(default), default=default)
    args = parser.parse_args(argv)
    s = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
    budget_s = args.seconds if args.seconds is not None else (5.0 if args.small else 180.0)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    manifest = json.loads((args.data / "manifest.json").read_text())
    special = manifest["special_token_ids"]
    arrays = {
        f"{kind}_{split}": np.load(args.data / f"{kind}_{split}.npy")
        for kind in ("code", "prose")
        for split in ("train", "val")
    }
    streams = {k: torch.from_numpy(a.astype(np.int64)).to(device) for k, a in arrays.items()}
    train_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_demo_model(args.target, device, train_dtype)
    tcfg = target.cfg
    shape = BlockDrafterShape(
        vocab_size=tcfg.vocab_size,
        hidden_size=tcfg.hidden_size,
        num_target_layers=tcfg.num_layers,
        target_layer_ids=spread_layer_ids(tcfg.num_layers, s.num_feature_layers),
        block_size=s.block_size,
        mask_token_id=special[MASK_TOKEN],
        intermediate_size=s.intermediate_size,
        num_layers=s.num_layers,
        num_heads=tcfg.num_heads,
        num_kv_heads=tcfg.num_kv_heads,
        head_dim=tcfg.head_dim,
        max_position_embeddings=tcfg.max_position_embeddings + s.block_size,
        rope_theta=tcfg.rope_theta,
        rms_norm_eps=tcfg.rms_norm_eps,
    )
    drafter = DemoBlockDrafter(shape, target.model.embed_tokens.weight.float()).to(device)
    print(f"block drafter params {drafter.num_params():,} {shape.as_dict()}", flush=True)

    t_gen = time.perf_counter()
    num_prose = round(s.pool_seqs * s.prose_seqs / s.batch_seqs)
    pools = {
        "code": generate_pool(target, streams["code_train"], s.pool_seqs - num_prose, s, gen),
        "prose": generate_pool(target, streams["prose_train"], num_prose, s, gen),
    }
    val_settings = replace(
        s, min_prompt_len=s.accept_prompt_len, max_prompt_len=s.accept_prompt_len
    )
    val_gen = torch.Generator().manual_seed(args.seed + 1)
    val = {
        kind: generate_pool(target, streams[f"{kind}_val"], s.val_seqs, val_settings, val_gen)
        for kind in ("code", "prose")
    }
    _sync(device)
    gen_s = time.perf_counter() - t_gen
    print(f"generated {s.pool_seqs} + {2 * s.val_seqs} sequences in {gen_s:.1f}s", flush=True)

    drafter, log = train(drafter, target, pools, val, s, budget_s, gen)
    save_block_drafter(drafter, args.out)
    record = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "settings": asdict(s),
        "shape": shape.as_dict(),
        "params": drafter.num_params(),
        "checkpoint_bytes": (args.out / "model.safetensors").stat().st_size,
        "mask_token": MASK_TOKEN,
        "generation_s": round(gen_s, 2),
        "pool_tokens": s.pool_seqs * s.seq_len,
        "log": log,
    }
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")

    # Measured from the saved bf16 weights in fp32, as `train` measures the pair.
    torch.backends.cuda.matmul.allow_tf32 = False
    t_eval = time.perf_counter()
    target32 = load_demo_model(args.target, device)
    drafter32 = load_trainable_block_drafter(args.out, target32.model.embed_tokens.weight)
    drafter32 = drafter32.to(device).eval().requires_grad_(False)
    draft32 = load_demo_model(args.draft, device)
    acceptance = {}
    for kind in ("code", "prose"):
        prompts = pick_prompts(
            arrays[f"{kind}_val"],
            s.accept_prompts,
            s.accept_prompt_len,
            s.accept_gen + SPEC_DEPTH,
            args.seed,
            special[END_OF_TEXT],
        )
        acceptance[kind] = measure_block_acceptance(
            target32, drafter32, draft32, torch.from_numpy(prompts).to(device), s.accept_gen
        )
        summary = {
            depth: {name: round(st["mean_accepted_len"], 3) for name, st in per.items()}
            for depth, per in acceptance[kind].items()
            if depth.startswith("depth_")
        }
        print(kind, json.dumps(summary), flush=True)
    record.update(
        acceptance=acceptance,
        eval_wall_s=round(time.perf_counter() - t_eval, 2),
        total_wall_s=round(time.perf_counter() - t_start, 2),
    )
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
