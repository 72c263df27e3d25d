"""The closed forms of `hipfire-bench coupling` against sampling."""

from __future__ import annotations

import torch

from loadtests.lab.coupled_acceptance import acceptances, tokens_per_round


def test_acceptances_match_monte_carlo():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(20, 40, generator=gen) * 2, -1).double()
    q = torch.softmax(torch.randn(20, 40, generator=gen) * 2, -1).double()
    rejection, coupling, bound = acceptances(p, q)
    noise = torch.empty(40000, 20, 40, dtype=torch.float64).exponential_(generator=gen)
    agree = ((p / noise).argmax(-1) == (q / noise).argmax(-1)).double().mean(0)
    assert torch.allclose(coupling, agree, atol=0.01)
    assert float(bound.max()) == 0.0  # 40 tokens: every one summed
    assert (coupling <= rejection + 1e-12).all()  # no exact rule beats 1 - TV
    same = acceptances(p, p)
    assert torch.allclose(same[0], torch.ones(20, dtype=torch.float64))
    assert torch.allclose(same[1], torch.ones(20, dtype=torch.float64))


def test_tokens_per_round_walks_the_survival_products():
    accept = torch.tensor([1.0, 0.5, 0.5, 1.0])
    # starts 0 and 1 at depth 3: 1 + 1 + 0.5 and 1 + 0.5 + 0.25
    assert tokens_per_round(accept, 3) == (2.5 + 1.75) / 2
