"""Acceptance estimator: survival as a linear map of the belief, and the prior's learning."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.acceptance import CALIB_WINDOW, LEVELS, SWITCH, AcceptanceEstimator


def recursive_survival(est: AcceptanceEstimator, belief: np.ndarray) -> np.ndarray:
    """The module doc's forward recursion, one belief row at a time."""
    out = np.empty((belief.shape[0], est.max_drafts))
    for i, b in enumerate(belief):
        v = b.copy()
        for j in range(est.max_drafts):
            v = v * LEVELS
            s = v.sum()
            out[i, j] = s
            v = (1.0 - SWITCH) * v + SWITCH * s * est.prior
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    max_drafts=st.integers(1, 9),
    prior_acceptance=st.floats(0.1, 0.95),
    num_rounds=st.integers(0, 6),
)
def test_survival_matrix_equals_the_recursion(seed, max_drafts, prior_acceptance, num_rounds):
    rng = np.random.default_rng(seed)
    num_slots = 6
    est = AcceptanceEstimator(num_slots, max_drafts, prior_acceptance)
    for _ in range(num_rounds):  # outcomes move beliefs and the prior (and drop the cache)
        slots = rng.choice(num_slots, size=3, replace=False)
        drafted = rng.integers(1, max_drafts + 1, size=3)
        est.observe(slots, drafted, rng.integers(0, drafted + 1))
        est.decay()
    slots = np.arange(num_slots)
    expected = recursive_survival(est, est.belief[slots])
    raw = est.belief[slots] @ est.survival_matrix()  # survival() scales it: calibration
    assert np.allclose(raw, expected, rtol=1e-12, atol=1e-15)
    belief = rng.dirichlet(np.ones(len(LEVELS)), size=4)
    assert np.allclose(est._survival(belief), recursive_survival(est, belief), atol=1e-15)


def test_prior_moves_with_first_positions_and_beliefs_with_whole_chains():
    """Deeper positions are only observed on chains that survived so far, so one round's
    update of the global prior uses its first-position outcomes; each request's own belief
    uses the whole chain."""
    short_chains = AcceptanceEstimator(num_slots=8, max_drafts=7)
    long_chains = AcceptanceEstimator(num_slots=8, max_drafts=7)
    slots = np.arange(8)
    drafted = np.full(8, 7)
    short_chains.observe(slots, drafted, np.ones(8, dtype=np.int64))  # pass 1, fail 2
    long_chains.observe(slots, drafted, np.full(8, 7))  # pass all 7
    assert np.allclose(short_chains.prior, long_chains.prior)
    assert (short_chains.survival(slots)[:, 0] < long_chains.survival(slots)[:, 0] - 0.1).all()
    # and the first positions do move it: all rejected against all accepted
    rejected = AcceptanceEstimator(num_slots=8, max_drafts=7)
    rejected.observe(slots, drafted, np.zeros(8, dtype=np.int64))
    assert rejected.global_acceptance()[0] < long_chains.global_acceptance()[0] - 0.03


def test_a_weighted_observation_counts_that_many_times_in_the_calibration():
    """calib_weight w adds w x the positions' predicted and realized survival to the sums
    (and ages them as w observations would), so a few probes can outweigh the pseudo-counts;
    beliefs and the prior learn as from one observation."""
    one, heavy = (AcceptanceEstimator(num_slots=2, max_drafts=4) for _ in range(2))
    slots, drafted, accepted = np.arange(2), np.array([3, 3]), np.array([3, 1])
    one.observe(slots, drafted, accepted)
    heavy.observe(slots, drafted, accepted, calib_weight=10.0)
    base = AcceptanceEstimator(num_slots=2, max_drafts=4)._calib_real  # the pseudo-counts
    drafted_per_pos = np.array([2, 2, 2, 0])  # both chains drafted positions 1..3
    realized = np.array([2.0, 1.0, 1.0, 0.0])  # accepted: both at 1, one of them at 2 and 3
    keep_one = np.exp(-drafted_per_pos / CALIB_WINDOW)
    keep_heavy = np.exp(-10.0 * drafted_per_pos / CALIB_WINDOW)
    assert np.allclose(one._calib_real, base * keep_one + realized)
    assert np.allclose(heavy._calib_real, base * keep_heavy + 10.0 * realized)
    assert np.allclose(heavy.belief, one.belief) and np.allclose(heavy.prior, one.prior)
    # realized above predicted: the heavy estimator's calibration moved ten times further
    move_one = one.calibration()[:3] - 1.0
    move_heavy = heavy.calibration()[:3] - 1.0
    assert (np.abs(move_heavy) > 3 * np.abs(move_one)).all()


def _learned(num_slots: int = 8, rounds: int = 300, p: float = 0.92, seed: int = 0):
    """An estimator that has seen `rounds` rounds of full-depth chains at acceptance `p`."""
    rng = np.random.default_rng(seed)
    est = AcceptanceEstimator(num_slots, 7)
    slots = np.arange(num_slots)
    for _ in range(rounds):
        accepted = np.minimum(rng.geometric(1.0 - p, size=num_slots) - 1, 7)
        est.observe(slots, np.full(num_slots, 7), accepted)
        est.decay()
    return est


def test_an_estimator_that_adopts_anothers_knowledge_starts_a_request_where_it_would():
    """What one estimator learned (prior, evidence, calibration) carried into a fresh one of
    another slot count: a new request there is predicted exactly as a new request in the
    first, far above the configured prior, and the evidence needs no probe."""
    from scheduler.acceptance import AcceptanceKnowledge

    learned = _learned()
    fresh = AcceptanceEstimator(4, 7)
    cold = fresh.survival(np.arange(4)).copy()
    assert fresh.needs_probe()
    known = learned.knowledge()
    assert isinstance(known, AcceptanceKnowledge) and len(known.prior) == len(LEVELS)
    fresh.adopt(known)
    learned.reset(3)
    np.testing.assert_allclose(fresh.survival(np.array([1])), learned.survival(np.array([3])))
    assert (fresh.survival(np.arange(4))[:, -1] > 1.5 * cold[:, -1]).all()
    assert not fresh.needs_probe()
    assert fresh.knowledge() == known  # adopting changes nothing the knowledge holds


def test_a_shallower_estimator_adopts_the_positions_it_has():
    learned = _learned()
    shallow = AcceptanceEstimator(2, 3)
    shallow.adopt(learned.knowledge())
    np.testing.assert_allclose(shallow.calibration(), learned.calibration()[:3])
    deeper = AcceptanceEstimator(2, 9)
    deeper.adopt(learned.knowledge())
    np.testing.assert_allclose(deeper.calibration()[:7], learned.calibration())
    np.testing.assert_allclose(deeper.calibration()[7:], 1.0)  # only pseudo-observations


def test_invalid_knowledge_is_refused_and_changes_nothing():
    import dataclasses

    import pytest

    known = _learned(rounds=20).knowledge()
    bad = [
        dataclasses.replace(known, prior=known.prior[:-1]),
        dataclasses.replace(known, prior=(0.0,) * len(LEVELS)),
        dataclasses.replace(known, prior=(float("nan"), *known.prior[1:])),
        dataclasses.replace(known, num_prior_obs=-1.0),
        dataclasses.replace(known, calib_pred=known.calib_pred[:-1]),
        dataclasses.replace(known, calib_pred=(0.0, *known.calib_pred[1:])),
        dataclasses.replace(known, calib_real=(float("inf"), *known.calib_real[1:])),
    ]
    est = AcceptanceEstimator(2, 7)
    before = est.knowledge()
    for k in bad:
        with pytest.raises(ValueError):
            est.adopt(k)
        assert est.knowledge() == before


def test_a_scheduler_adopts_knowledge_only_before_its_first_request():
    import pytest

    from scheduler.cost_model import CostModel, ProfileCost
    from scheduler.plan import SamplingSpec
    from scheduler.request import RequestSpec
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from scheduler.sim.plan_bench import PROFILES

    cost = CostModel(ProfileCost.from_file(PROFILES / "h200-qwen3-8b.json"))
    known = _learned().knowledge()
    sched = Scheduler(SchedulerConfig(max_concurrency=2, block_size=4), 100, cost)
    sched.adopt_acceptance(known)
    assert sched.acceptance_knowledge() == known
    spec = RequestSpec(req_id=1, prompt_token_ids=(1, 2, 3), sampling=SamplingSpec(), max_tokens=4)
    sched.add_request(spec)
    with pytest.raises(RuntimeError):
        sched.adopt_acceptance(known)
