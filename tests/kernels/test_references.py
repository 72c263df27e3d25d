"""Every kernel wrapper and its torch reference take the same arguments: the executor's op sets
(`executor.ops`) swap one for the other, and the tests compare them call for call."""

from __future__ import annotations

import importlib
import inspect

import pytest

PAIRS = [
    ("attention", "verify_attention"),
    ("fused_qk", "qk_norm_rope_and_write_kv"),
    ("rope_kv", "rope_and_write_kv"),
    ("accept", "accept_greedy"),
    ("accept", "accept_rejection"),
    ("norms", "rms_norm"),
    ("norms", "head_rms_norm"),
    ("norms", "silu_and_mul"),
    ("argmax", "argmax_rows"),
    ("argmax", "topk_rows"),
]


@pytest.mark.parametrize(("module", "name"), PAIRS)
def test_reference_takes_the_wrappers_arguments(module, name):
    mod = importlib.import_module(f"kernels.{module}")
    wrapper, reference = getattr(mod, name), getattr(mod, f"{name}_ref")
    assert inspect.signature(reference) == inspect.signature(wrapper)
