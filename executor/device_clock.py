"""Timing of work queued on a device, read once the device has done it."""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Times consecutive phases of work queued on a device without waiting for it: CUDA events
    on a GPU (read after the proposal's one copy back has synchronised), the host clock on a
    CPU, where the work runs as it is issued."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.marks = [self.now()]

    def now(self):
        """A mark of the device's timeline at this point of the queued work."""
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, a, b) -> float:
        """Milliseconds from mark a to mark b (the device must have passed b)."""
        return a.elapsed_time(b) if self.events else (b - a) * 1e3

    def mark(self) -> None:
        self.marks.append(self.now())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks."""
        return [self.ms(a, b) for a, b in zip(self.marks, self.marks[1:])]
