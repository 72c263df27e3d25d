"""The device's side of a timing: synchronising before reading the clock, and the copy and GEMM
ceilings of the device measured in the same run as a profile."""

from __future__ import annotations

import statistics

import torch


def sync_device(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (read + write) and bf16 GEMM rate of this device, measured now."""
    if device.type != "cuda":
        return {}
    n = 1 << 30  # 1 GiB of bytes per buffer: far past the L2
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    copy_tbps = 2 * n / (statistics.median(times) * 1e-3) / 1e12
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    gemm_tflops = 2 * m**3 / (statistics.median(times) * 1e-3) / 1e12
    return {
        "copy_read_plus_write_TBps": round(copy_tbps, 3),
        "bf16_gemm_TFLOPs": round(gemm_tflops, 1),
    }
