"""The target's hidden states after chosen decoder layers, written by its forward into a buffer
the caller owns (a block drafter's context features are projected from them).

Layer id i means the output of decoder layer i, HF's `output_hidden_states[i + 1]`, so a drafter
trained on those tensors reads the same values here. The buffer is allocated once for the most
rows a forward can have; a forward of `num_rows` rows fills its first `num_rows` rows and nothing
else, so a CUDA graph captured over the forward replays into the same static storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HiddenCapture:
    layer_ids: tuple[int, ...]  # decoder layers to capture, in column order
    out: torch.Tensor  # [max_rows, len(layer_ids) * hidden]: layer_ids[j] at columns j*hidden..
    # layer id -> its column block of `out`, [max_rows, hidden] (a view)
    columns: dict[int, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        ids = tuple(int(i) for i in self.layer_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids must be distinct and non-empty, got {ids}")
        if self.out.dim() != 2 or self.out.shape[1] % len(ids) != 0:
            raise ValueError(f"out must be [max_rows, {len(ids)} * hidden], got {self.out.shape}")
        hidden = self.out.shape[1] // len(ids)
        columns = {i: self.out[:, j * hidden : (j + 1) * hidden] for j, i in enumerate(ids)}
        object.__setattr__(self, "layer_ids", ids)
        object.__setattr__(self, "columns", columns)

    @classmethod
    def allocate(
        cls,
        layer_ids: tuple[int, ...] | list[int],
        max_rows: int,
        hidden: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> HiddenCapture:
        out = torch.empty(max_rows, len(layer_ids) * hidden, dtype=dtype, device=device)
        return cls(tuple(layer_ids), out)

    @property
    def max_rows(self) -> int:
        return self.out.shape[0]

    def check_fits(self, num_layers: int, hidden: int, num_rows: int, dtype: torch.dtype) -> None:
        """Raises ValueError naming what does not fit a forward of `num_rows` rows of a model
        with `num_layers` layers of width `hidden` computing in `dtype`."""
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layer_ids {bad} outside the model's {num_layers} layers")
        if self.out.shape[1] != len(self.layer_ids) * hidden:
            raise ValueError(
                f"out has {self.out.shape[1]} columns, expected {len(self.layer_ids)} * {hidden}"
            )
        if num_rows > self.max_rows:
            raise ValueError(f"{num_rows} rows exceed the capture buffer's {self.max_rows}")
        if self.out.dtype != dtype:
            raise ValueError(f"out is {self.out.dtype}, the forward computes in {dtype}")

    def store(self, layer_id: int, hidden: torch.Tensor) -> None:
        """hidden [num_rows, hidden]: layer `layer_id`'s output; copied into the buffer's first
        num_rows rows when the layer is one of `layer_ids`."""
        dst = self.columns.get(layer_id)
        if dst is not None:
            dst[: hidden.shape[0]].copy_(hidden)

    def rows(self, num_rows: int) -> torch.Tensor:
        """The captured states of the last forward's first `num_rows` rows (a view of `out`),
        [num_rows, len(layer_ids) * hidden]."""
        return self.out[:num_rows]
