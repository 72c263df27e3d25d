"""The model's device operations behind one switch: Triton kernels on a GPU, their pure-torch
references elsewhere (same signatures and layouts). The model never branches on the device."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

# Linear layers through `ops.linear` (kernels.skinny_linear: Triton at 1-16 rows where its table
# holds a measured win over cuBLAS, torch otherwise) instead of torch's F.linear directly: on by
# default, as `hipfire-bench linear` finds (docs/perf/linear.md); HIPFIRE_SKINNY_LINEAR=1/0
# overrides it.
SKINNY_LINEAR_DEFAULT = True


def skinny_linear_enabled() -> bool:
    value = os.environ.get("HIPFIRE_SKINNY_LINEAR")
    return SKINNY_LINEAR_DEFAULT if value is None else value == "1"


def pdl_enabled(device: torch.device) -> bool:
    """Whether the forward's Triton kernels launch with programmatic dependent launch on
    `device` (kernels.arch: NVIDIA sm90+ with a Triton that has it; on by default, off with
    HIPFIRE_PDL=0, read once per process). Never on a CPU, under the interpreter or on AMD."""
    return _load("arch", "pdl_enabled")(device)


def pdl_forced(enabled: bool):
    """Context manager: PDL on (where capable) or off for the launches and graph captures made
    inside it; a captured graph keeps the launches it was captured with."""
    return _load("arch", "pdl_forced")(enabled)


@dataclass(frozen=True)
class OpSet:
    rms_norm: object
    qk_norm_rope_and_write_kv: object
    silu_and_mul: object
    verify_attention: object
    argmax_rows: object
    linear: object  # F.linear's signature; the model calls it only when skinny_linear_enabled()
    # whether these are the Triton kernels (quantized layers then run their own kernels too)
    kernels: bool = False
    # (positions, slot_mapping, cos_sin, meta=None, causal=True) -> a plan the forward hands to
    # qk_norm_rope_and_write_kv and verify_attention as `plan=`; None: they take no plan
    forward_plan: object = None


def _load(name: str, attr: str):
    return getattr(importlib.import_module(f"kernels.{name}"), attr)


# (OpSet field, kernels module, kernel); each kernel's pure-torch reference is `<kernel>_ref`
_KERNELS = (
    ("rms_norm", "norms", "rms_norm"),
    ("qk_norm_rope_and_write_kv", "fused_qk", "qk_norm_rope_and_write_kv"),
    ("silu_and_mul", "norms", "silu_and_mul"),
    ("verify_attention", "attention", "verify_attention"),
    ("argmax_rows", "argmax", "argmax_rows"),
)


def reference_ops() -> OpSet:
    ops = {field: _load(module, f"{name}_ref") for field, module, name in _KERNELS}
    return OpSet(**ops, linear=torch.nn.functional.linear)


def cpu_ops() -> OpSet:
    """The references with their per-forward work done once per forward (executor/cpu_ops.py):
    bitwise the same results, far fewer torch calls per layer."""
    from executor import cpu_ops as cpu

    return OpSet(
        rms_norm=cpu.rms_norm,
        qk_norm_rope_and_write_kv=cpu.qk_norm_rope_and_write_kv,
        silu_and_mul=cpu.silu_and_mul,
        verify_attention=cpu.verify_attention,
        argmax_rows=_load("argmax", "argmax_rows_ref"),
        linear=cpu.linear,
        forward_plan=cpu.forward_plan,
    )


def triton_ops() -> OpSet:
    ops = {field: _load(module, name) for field, module, name in _KERNELS}
    return OpSet(**ops, linear=_load("skinny_linear", "linear"), kernels=True)


def select_ops(device: torch.device, backend: str = "auto") -> OpSet:
    """backend: 'auto' (Triton on CUDA/ROCm when available), 'triton' or 'torch' (the torch
    references; on a CPU in their per-forward form, `cpu_ops`)."""
    if backend == "torch":
        return cpu_ops() if device.type == "cpu" else reference_ops()
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
    return cpu_ops() if device.type == "cpu" else reference_ops()
