"""Reward: process pool, per-score timeouts, failures as recorded results (the RewardActor on a local Ray:
tests/integration/test_reward_actor.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayrl.config import ConfigError
from rayrl.scoring import Reward
from tests.helpers import reward_request

SCORER = "tests.helpers:slow_or_exact"


@pytest.fixture(scope="module")
def scorer():
    s = Reward(SCORER, timeout=1.0, num_procs=2)
    yield s
    s.close()


def test_scores_in_order(scorer: Reward) -> None:
    batch = [reward_request("a", "5"), reward_request("b", "6", sleep=0.5), reward_request("c", " 5 ")]
    results = asyncio.run(scorer.score(batch))
    assert [(r.task_id, r.score, r.error) for r in results] == [("a", 1.0, None), ("b", 0.0, None), ("c", 1.0, None)]
    assert results[1].seconds >= 0.5  # the time recorded covers the score itself (the scorer slept 0.5 s)


def test_timeout_kills_and_pool_survives(scorer: Reward) -> None:
    start = time.monotonic()
    slow, fast = asyncio.run(scorer.score([reward_request("slow", "5", sleep=30), reward_request("fast", "5")]))
    assert time.monotonic() - start < 15  # the 30 s scorer was killed, not waited for
    assert slow.score is None and slow.error == "reward timed out after 1s"
    assert 1.0 <= slow.seconds < 15  # recorded from submission to the kill at the 1 s timeout
    assert fast.score == 1.0 and fast.error is None
    # the killed worker was replaced: both workers score again
    again = asyncio.run(scorer.score([reward_request("n1", "5"), reward_request("n2", "4")]))
    assert [(r.score, r.error) for r in again] == [(1.0, None), (0.0, None)]
    assert scorer.stats()["timeouts"] >= 1


def test_raising_scorer_is_an_error_not_zero() -> None:
    s = Reward("tests.helpers:raising", timeout=5.0, num_procs=1)
    try:
        (r,) = asyncio.run(s.score([reward_request("x", "oops")]))
        assert r.score is None and r.error == "ValueError: cannot score 'oops'"
        assert not r.ok
    finally:
        s.close()


def test_crashing_worker_is_an_error() -> None:
    s = Reward("tests.helpers:crash", timeout=5.0, num_procs=1)
    try:
        (r,) = asyncio.run(s.score([reward_request("x", "5")]))
        assert r.score is None and r.error.startswith("ProcessExpired")
    finally:
        s.close()


def test_bad_spec_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match="reward.fn"):
        Reward("no_such_module_xyz:fn", timeout=1.0, num_procs=1)
