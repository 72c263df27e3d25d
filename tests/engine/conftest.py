"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.fixtures.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3-architecture checkpoint in HF format (weights, tokenizer, chat template)."""
    return make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3", seed=3)
