"""The catch-up probe refuses to run without a GPU, with one line and a non-zero status."""

from __future__ import annotations

import pytest
import torch

from loadtests.catchup_probe import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the probe would run")
def test_without_a_gpu_the_probe_says_so_and_fails(capsys):
    assert main(["--rows", "256"]) == 1
    assert capsys.readouterr().out.strip() == "catchup_probe: needs a CUDA GPU"
