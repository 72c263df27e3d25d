"""One round's inputs packed into one host byte buffer and uploaded with one non-blocking copy."""

from __future__ import annotations

import numpy as np
import torch

_TORCH_DTYPE = {
    np.dtype(np.int64).char: torch.int64,
    np.dtype(np.int32).char: torch.int32,
    np.dtype(np.float32).char: torch.float32,
    np.dtype(np.bool_).char: torch.bool,
}


class HostBuffer:
    """Named arrays packed into a (pinned on a GPU, double-buffered) host byte buffer and
    uploaded with one non-blocking copy into a persistent device buffer. Every array starts on
    a 16-byte boundary: Triton specialises a kernel on whether each pointer is 16-byte aligned,
    so arrays packed back to back would compile new variants as row counts change (seconds
    each, inside a serving round). The device views are cached per layout, so a steady run of
    same-shaped rounds creates no tensors at all; reusing the device buffer is safe because the
    copy is ordered on the stream after the previous round's kernels."""

    ALIGN = 16

    def __init__(self, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self.pinned = pinned
        self.bufs: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
        self.dev_buf = torch.empty(0, dtype=torch.uint8, device=device)
        self.which = 0
        self.items: list[tuple[str, np.ndarray]] = []
        self._views: dict[tuple, dict[str, torch.Tensor]] = {}

    def start(self) -> None:
        self.items = []
        self.which ^= 1

    def add(self, name: str, values: np.ndarray, dtype) -> None:
        self.items.append((name, np.ascontiguousarray(values, dtype=dtype)))

    def upload(self) -> dict[str, torch.Tensor]:
        align = self.ALIGN
        starts = []
        size = 0
        for _, v in self.items:
            starts.append(size)
            size += -(-v.nbytes // align) * align
        buf = self.bufs[self.which]
        if buf.numel() < size:
            buf = torch.empty(
                max(size, 2 * buf.numel(), 4096), dtype=torch.uint8, pin_memory=self.pinned
            )
            self.bufs[self.which] = buf
        host = buf.numpy()
        for (_, v), start in zip(self.items, starts):
            host[start : start + v.nbytes] = v.reshape(-1).view(np.uint8)
        if self.dev_buf.numel() < size:
            self.dev_buf = torch.empty(buf.numel(), dtype=torch.uint8, device=self.device)
            self._views = {}
        self.dev_buf[:size].copy_(buf[:size], non_blocking=True)  # the one host -> device copy
        key = tuple((name, v.shape, v.dtype.char) for name, v in self.items)
        views = self._views.get(key)
        if views is None:
            views = {}
            for (name, v), start in zip(self.items, starts):
                flat = self.dev_buf[start : start + v.nbytes].view(_TORCH_DTYPE[v.dtype.char])
                views[name] = flat if v.ndim == 1 else flat.view(v.shape)
            if len(self._views) > 256:  # shapes drift with contexts: keep the cache small
                self._views = {}
            self._views[key] = views
        return views
