"""The decode roofline of the wave at each C: the bytes one step reads (weights, `shape.
step_weight_bytes`, and the KV of every live context) at the copy bandwidth measured in the same
call, beside the step's dense and attention FLOPs at the measured bf16 GEMM rate; the bound is
the larger. A wave's decode steps see contexts from prompt + 1 to prompt + N tokens, so the
mean step reads the KV of prompt + (N + 1) / 2 tokens per request. A hybrid target's step also
reads and writes every sequence's recurrent state once (`state_bytes`)."""

from __future__ import annotations

from executor.model_config import ModelConfig
from loadtests.lab.peer.config import PeerConfig
from loadtests.lab.peer.shape import (
    DTYPE_BYTES,
    matmul_params,
    state_bytes_per_seq,
    step_weight_bytes,
)
from loadtests.lab.peer.workloads import wave_lens


def wave_roofline(cfg: PeerConfig, shape: ModelConfig, dtype: str, ceilings: dict) -> list[dict]:
    elt = DTYPE_BYTES[dtype]
    bw = (ceilings or {}).get("copy_read_plus_write_TBps")
    gemm = (ceilings or {}).get("bf16_gemm_TFLOPs")
    out = []
    for c in cfg.concurrency:
        kv_tokens = sum(wave_lens(cfg, c)) + c * (cfg.decode_tokens + 1) / 2
        weight_bytes = step_weight_bytes(shape, elt, c)
        kv_bytes = kv_tokens * shape.kv_bytes_per_token(elt)
        state_bytes = 2 * c * state_bytes_per_seq(shape, elt)
        # q.k and p.v over every context, per layer and query head
        flops = 2 * matmul_params(shape) * c + 4 * kv_tokens * shape.q_size * shape.num_layers
        moved = weight_bytes + kv_bytes + state_bytes
        bytes_ms = moved / (bw * 1e12) * 1e3 if bw else None
        flops_ms = flops / (gemm * 1e12) * 1e3 if gemm else None
        step_ms = max(bytes_ms, flops_ms or 0.0) if bytes_ms else None
        out.append(
            {
                "C": c,
                "weight_bytes": weight_bytes,
                "kv_bytes": kv_bytes,
                "state_bytes": state_bytes,
                "flops": flops,
                "bytes_ms": bytes_ms,
                "flops_ms": flops_ms,
                "step_ms": step_ms,
                "decode_tok_s": c / step_ms * 1e3 if step_ms else None,
            }
        )
    return out
