"""Without a GPU the kernels run in Triton's interpreter (small shapes, fp16/fp32 only).

`triton.jit` picks the interpreter when a kernel is decorated, so the flag is set before the
kernel modules load, and modules another test area imported earlier are loaded again.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in (
        "kernels.arch",
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
