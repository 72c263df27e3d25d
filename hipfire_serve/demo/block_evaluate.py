"""Acceptance of the block drafter beside the chain draft model, on the same prompts.

The target's greedy continuation of each prompt is the reference (as in `evaluate`). After i
generated tokens the verified context holds prompt_len + i tokens; the block is anchored at its
last token (position prompt_len + i - 1) and sees the target's features of the positions before
it, exactly what serving hands the drafter, since the target is causal and its states over
prompt + reference are those of every prefix. Its B - 1 drafts are walked in speculative
rounds (`simulate_rounds`: accept the common prefix with the reference, emit accepted + 1,
advance by that). At a depth below B the round verifies the block's first depth - 1 drafts,
as the executor does. The chain draft model's greedy chain from the same context is walked the
same way; a greedy chain's first k tokens are its k-token chain, so one long chain serves
every depth.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from hipfire_serve.demo.block_drafter import DemoBlockDrafter, target_states
from hipfire_serve.demo.evaluate import (
    draft_chains,
    greedy_generate,
    ngram_propose,
    simulate_rounds,
    summarize_rounds,
)
from hipfire_serve.demo.model import DemoCausalLM, DemoModelConfig

CHAIN_DEPTH = 8  # the depth the shipped pair's acceptance is recorded at (docs/demo-model.md)


def load_demo_model(model_dir: Path | str, device, dtype=torch.float32) -> DemoCausalLM:
    """A shipped HF model directory as a DemoCausalLM (bf16 weights cast to `dtype`)."""
    model_dir = Path(model_dir)
    cfg = DemoModelConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    model = DemoCausalLM(cfg)
    state = load_file(str(model_dir / "model.safetensors"))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


@torch.no_grad()
def block_proposals(
    target: DemoCausalLM,
    drafter: DemoBlockDrafter,
    seqs: torch.Tensor,
    prompt_len: int,
    num_gen: int,
    chunk: int = 8,
) -> torch.Tensor:
    """seqs [n, prompt_len + num_gen + ..] (prompt + reference) -> drafts [n, num_gen, B - 1]:
    drafts[b, i] is the block drafted after i generated tokens."""
    out = []
    anchors = torch.arange(num_gen, device=seqs.device) + prompt_len - 1  # [G]
    for rows in seqs.split(chunk):
        hidden, _ = target_states(target, rows, drafter.shape.target_layer_ids)
        block = drafter(hidden, rows, anchors.expand(rows.shape[0], num_gen))  # [c, G, B, H]
        out.append(drafter.logits(block[:, :, 1:]).argmax(-1))  # [c, G, B - 1]
    return torch.cat(out)


def _rounds(reference: np.ndarray, proposals, num_gen: int, num_draft: int) -> list:
    rounds = []
    for b in range(reference.shape[0]):
        rounds += simulate_rounds(
            reference[b].tolist(),
            num_gen,
            num_draft,
            lambda i, b=b: proposals(b, i)[:num_draft],
        )
    return rounds


@torch.no_grad()
def measure_block_acceptance(
    target: DemoCausalLM,
    drafter: DemoBlockDrafter,
    draft: DemoCausalLM,
    prompts: torch.Tensor,
    num_gen: int,
    depths: tuple[int, ...] | None = None,
) -> dict:
    """Per depth: RoundStats of the block drafter, the chain draft model and ngram, against
    the target's greedy continuation of prompts [n, P]. Default depths: 8 and B."""
    block_size = drafter.shape.block_size
    depths = depths or tuple(sorted({min(CHAIN_DEPTH, block_size), block_size}))
    max_draft = max(depths) - 1
    assert max_draft <= block_size - 1, (depths, block_size)
    prompt_len = prompts.shape[1]
    reference = greedy_generate(target, prompts, num_gen + max_draft)  # [n, G + d]
    seqs = torch.cat([prompts, reference], dim=1)
    blocks = block_proposals(target, drafter, seqs, prompt_len, num_gen).cpu().numpy()
    chains = draft_chains(draft, seqs, prompt_len, num_gen, max_draft).cpu().numpy()
    seqs_np, ref_np = seqs.cpu().numpy(), reference.cpu().numpy()
    result: dict = {"num_prompts": int(prompts.shape[0]), "prompt_len": prompt_len}
    result["num_gen"] = num_gen
    for depth in depths:
        num_draft = depth - 1
        ngram = _rounds(
            ref_np,
            lambda b, i, d=num_draft: ngram_propose(seqs_np[b, : prompt_len + i].tolist(), d),
            num_gen,
            num_draft,
        )
        result[f"depth_{depth}"] = {
            "block": summarize_rounds(
                _rounds(ref_np, lambda b, i: blocks[b, i].tolist(), num_gen, num_draft),
                num_draft,
            ).as_dict(),
            "draft-model": summarize_rounds(
                _rounds(ref_np, lambda b, i: chains[b, i].tolist(), num_gen, num_draft),
                num_draft,
            ).as_dict(),
            "ngram": summarize_rounds(ngram, num_draft).as_dict(),
        }
    return result
