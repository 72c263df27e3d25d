"""One sequence through `Model.forward` (a fresh paged KV cache each call): the logits of a
prompt and greedy continuations, for comparing a quantized checkpoint's model with its dense
reference."""

from __future__ import annotations

import torch

from executor.kv_cache import KVCache
from executor.model import AttnMetadata, Model

BLOCK = 16


def prompt_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] float32 of one prefill of `ids`."""
    num_blocks = -(-len(ids) // BLOCK)
    kv = KVCache.for_model(model, num_blocks=num_blocks, block_size=BLOCK)
    positions = torch.arange(len(ids))
    meta = AttnMetadata(
        positions=positions,
        slot_mapping=positions,  # blocks 0.. in order: slot = position
        cu_q_lens=torch.tensor([0, len(ids)], dtype=torch.int32),
        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
    )
    return model.logits(model.forward(torch.tensor(ids), meta, kv.k, kv.v))


def greedy(model: Model, ids: list[int], num_tokens: int) -> list[int]:
    out = list(ids)
    for _ in range(num_tokens):
        out.append(int(prompt_logits(model, out)[-1].argmax()))
    return out[len(ids) :]
