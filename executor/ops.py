"""The model's device operations behind one switch: Triton kernels on a GPU, their pure-torch
references elsewhere (same signatures and layouts). The model never branches on the device."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpSet:
    rms_norm: object
    qk_norm_rope_and_write_kv: object
    silu_and_mul: object
    verify_attention: object
    argmax_rows: object


def _load(name: str, attr: str):
    return getattr(importlib.import_module(f"kernels.{name}"), attr)


def reference_ops() -> OpSet:
    return OpSet(
        rms_norm=_load("norms", "rms_norm_ref"),
        qk_norm_rope_and_write_kv=_load("fused_qk", "qk_norm_rope_and_write_kv_ref"),
        silu_and_mul=_load("norms", "silu_and_mul_ref"),
        verify_attention=_load("attention", "verify_attention_ref"),
        argmax_rows=_load("argmax", "argmax_rows_ref"),
    )


def triton_ops() -> OpSet:
    return OpSet(
        rms_norm=_load("norms", "rms_norm"),
        qk_norm_rope_and_write_kv=_load("fused_qk", "qk_norm_rope_and_write_kv"),
        silu_and_mul=_load("norms", "silu_and_mul"),
        verify_attention=_load("attention", "verify_attention"),
        argmax_rows=_load("argmax", "argmax_rows"),
    )


def select_ops(device: torch.device, backend: str = "auto") -> OpSet:
    """backend: 'auto' (Triton on CUDA/ROCm when available), 'triton' or 'torch'."""
    if backend == "torch":
        return reference_ops()
    if backend == "triton" or device.type == "cuda":
        try:
            from kernels.arch import kernels_available

            if kernels_available(device):
                return triton_ops()
        except ImportError:
            if backend == "triton":
                raise
        if backend == "triton":
            raise RuntimeError(f"Triton kernels are not available on {device}")
    return reference_ops()
