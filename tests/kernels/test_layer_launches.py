"""The GPU path of a model forward, run through Triton's interpreter on tiny models: the kernels
one layer launches, in order, and the logits against the torch reference path.

Every device kernel of a forward is either a Triton launch inside an `ops.*` call or a torch op
outside them (GEMMs, copies, casts). Views and allocations launch nothing and are not counted.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from executor.model import AttnMetadata, Model
from executor.ops import OpSet, reference_ops, triton_ops
from executor.random_model import PRESETS
from tests.kernels.models import random_norms_model
from tests.kernels.paged import rel_err

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter launch count")

QWEN3_LAYER = [
    "_rms_norm_kernel",
    "mm",  # qkv
    "_qk_norm_rope_kv_kernel",
    "verify_attention",
    "mm",  # o_proj
    "_rms_norm_kernel",  # with the residual add
    "mm",  # gate_up
    "_silu_and_mul_kernel",
    "mm",  # down
]
# Before the fused kernel a layer also ran two head norms, a copy of v (or of q, k and v without
# q/k norm) and a separate RoPE + KV store: 12 kernels in place of these 9.
KERNELS_PER_LAYER_BEFORE = 12


class _KernelLog(TorchDispatchMode):
    """Records the torch ops that launch a kernel while no `ops.*` call is running."""

    def __init__(self, log: list[str], inside: list[bool]):
        super().__init__()
        self.log, self.inside = log, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside[0] and not func.is_view and not name.startswith("empty"):
            self.log.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _logged(model: Model, monkeypatch):
    """Yields the list that fills with one entry per kernel the forward launches: a torch op
    name, a Triton kernel name, or "verify_attention" for the whole attention call (its kernel
    count belongs to the attention module)."""
    log: list[str] = []
    inside = [False]
    launches: list[str] = []
    real_run = InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)

    def wrap(name, fn):
        def call(*args, **kwargs):
            # linear: the skinny kernel where tuned, else torch's GEMM (logged as a torch op)
            inside[0] = name != "linear"
            launches.clear()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
                if name == "verify_attention":
                    log.append(name)
                elif name == "linear":
                    assert len(launches) <= 1, (name, launches)
                    log.extend(launches)
                else:
                    assert len(launches) == 1, (name, launches)  # one kernel per op
                    log.extend(launches)

        return call

    ops = model.ops
    fields = {f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)}
    # (an op set without a forward plan leaves the field None: nothing to wrap)
    model.ops = OpSet(**{n: fn if fn is None else wrap(n, fn) for n, fn in fields.items()})
    try:
        with _KernelLog(log, inside):
            yield log
    finally:
        model.ops = ops


def _tiny_model(qk_norm: bool, qkv_bias: bool) -> Model:
    """Two layers of 4 q / 2 kv heads of 16."""
    cfg = dataclasses.replace(PRESETS["tiny"], qk_norm=qk_norm, qkv_bias=qkv_bias)
    return random_norms_model(cfg, torch.device("cpu"), torch.float32, max_position=256)


def _batch(model: Model):
    """A 3-row chunk after 5 cached tokens, one AR row at position 9, one padded row; pages of
    4 tokens scattered over a 10-block cache filled with random context."""
    block = 4
    tables = torch.tensor([[7, 2, 5, 0], [4, 9, 1, 0]], dtype=torch.int32)
    rows = [(0, p) for p in (5, 6, 7)] + [(1, 9)]
    slots = [int(tables[s, p // block]) * block + p % block for s, p in rows] + [-1]
    meta = AttnMetadata(
        positions=torch.tensor([p for _, p in rows] + [0]),
        slot_mapping=torch.tensor(slots),
        cu_q_lens=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([8, 10], dtype=torch.int32),
        block_tables=tables,
        max_q_len=3,
    )
    gen = torch.Generator().manual_seed(4)
    shape = (10, block, model.config.num_kv_heads, model.config.head_dim)
    caches = [torch.randn(shape, generator=gen) for _ in range(2 * model.config.num_layers)]
    ids = torch.randint(0, model.config.vocab_size, (5,), generator=gen)
    return ids, meta, caches


@pytest.mark.parametrize(
    "qk_norm,qkv_bias",
    [(True, False), (False, False), (False, True)],
    ids=["qwen3", "llama", "qwen2"],
)
def test_layer_kernels_and_logits(qk_norm, qkv_bias, monkeypatch):
    model = _tiny_model(qk_norm, qkv_bias)
    ids, meta, caches = _batch(model)
    num_layers = model.config.num_layers
    k_ref, v_ref = (
        [c.clone() for c in caches[:num_layers]],
        [c.clone() for c in caches[num_layers:]],
    )
    k_got, v_got = (
        [c.clone() for c in caches[:num_layers]],
        [c.clone() for c in caches[num_layers:]],
    )

    model.ops = reference_ops()
    want = model.logits(model.forward(ids, meta, k_ref, v_ref))
    model.ops = triton_ops()
    with _logged(model, monkeypatch) as log:
        hidden = model.forward(ids, meta, k_got, v_got)
    got = model.logits(hidden)

    layer = [
        ("addmm" if qkv_bias and n == "mm" and j == 1 else n) for j, n in enumerate(QWEN3_LAYER)
    ]
    assert log == ["index"] + layer * num_layers + ["_rms_norm_kernel"]  # embed ... final norm
    assert len(layer) < KERNELS_PER_LAYER_BEFORE
    real = meta.slot_mapping >= 0
    assert rel_err(got[real], want[real]) < 1e-5
    for a, b in zip(k_got + v_got, k_ref + v_ref):
        assert (a - b).abs().max() < 1e-5
