"""A served CPU engine leaves a core to the event loop (`serving_threads`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from hipfire_serve.server.engine_loop import EngineDriver, serving_threads


@pytest.fixture
def restore_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _engine(device: str):
    return SimpleNamespace(device=torch.device(device))


def test_cpu_engine_leaves_a_core(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.set_num_threads(2)
    assert serving_threads(_engine("cpu")) == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert serving_threads(_engine("cpu")) == 1  # never below one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    torch.set_num_threads(3)
    assert serving_threads(_engine("cpu")) == 3  # never above torch's own choice


def test_driver_sets_threads_only_where_asked(monkeypatch, restore_threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert EngineDriver(_engine("cpu")).torch_threads is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert EngineDriver(_engine("cuda")).torch_threads is None
    assert EngineDriver(SimpleNamespace()).torch_threads is None  # a test double
    assert torch.get_num_threads() == 2
    assert EngineDriver(_engine("cpu")).torch_threads == 1
