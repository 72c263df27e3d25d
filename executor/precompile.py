"""Compiling ahead of serving: every attention kernel variant the rounds of the target and of a
draft model can pick, so that no serving round waits for a compile (a drafter catching up after
AR rounds or a new prefill shape would otherwise stall for seconds)."""

from __future__ import annotations

import torch

from executor.round_executor import RoundExecutor


def compile_attention_variants(executor: RoundExecutor, *, max_q_len: int) -> int:
    """Compiles the variants for rounds of up to `max_q_len` query rows per sequence on the
    executor's slots and block tables (GPU only; models on the torch reference ops need none)
    and waits for the device. Returns the number of variants compiled."""
    if executor.device.type != "cuda":
        return 0
    from kernels.attention import compile_variants, verify_attention

    models = [(executor.target, executor.kv)]
    inner = getattr(executor.drafter, "inner", executor.drafter)
    if getattr(inner, "model", None) is not None and getattr(inner, "kv", None) is not None:
        models.append((inner.model, inner.kv))
    num = 0
    for model, kv in models:
        if model.ops.verify_attention is not verify_attention:
            continue  # torch reference ops: nothing to compile
        num += compile_variants(
            kv.k[0],
            kv.v[0],
            model.config.num_q_heads,
            max_seqs=executor.max_slots,
            max_q_len=max_q_len,
            max_kv_len=executor.max_blocks_per_seq * executor.block_size,
            q_dtype=model.dtype,
        )
    torch.cuda.synchronize(executor.device)
    return num
