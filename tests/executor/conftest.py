"""Fixtures shared by the drafter tests."""

from __future__ import annotations

import pytest
import torch

from executor.loader import load_model
from executor.model import Model
from tests.fixtures.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small models run faster on one thread than split over many (and 2-core CI agrees)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> Model:
    """A tiny Qwen3 checkpoint, loaded: the draft model of the drafter tests."""
    return load_model(make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen3", seed=1))
