"""Without a GPU the kernels run in Triton's interpreter (small shapes, fp16/fp32 only).

`triton.jit` picks the interpreter when a kernel is decorated, so the flag is set before the
kernel modules load, and modules another test area imported earlier are loaded again.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in (
        "kernels.arch",
        "kernels.attention_kernel",
        "kernels.attention_tiling",
        "kernels.attention",
        "kernels.rope_kv",
        "kernels.norms",
        "kernels.fused_qk",
        "kernels.argmax",
        "kernels.accept",
        "kernels.skinny_linear",
    ):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


@pytest.fixture
def tiles():
    """Edits the attention tiles of the arch-table entry this device uses (the interpreter
    plans with the CPU's entry); returns the edited tiles; restores the entry afterwards."""
    import dataclasses

    from kernels import arch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = arch.arch_config(device).family
    saved = arch.FAMILY_CONFIGS[family]

    def set_tiles(**changes):
        arch.FAMILY_CONFIGS[family] = dataclasses.replace(
            saved, attention=dataclasses.replace(saved.attention, **changes)
        )
        arch._config_for.cache_clear()
        return arch.arch_config(device).attention

    yield set_tiles
    arch.FAMILY_CONFIGS[family] = saved
    arch._config_for.cache_clear()
