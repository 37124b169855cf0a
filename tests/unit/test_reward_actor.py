"""Reward: process pool, per-score timeouts, failures as recorded results; RewardActor on a local Ray."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rayrl.actors.reward import Reward, RewardRequest
from rayrl.config import ConfigError

SCORER = "tests.helpers_rewards:slow_or_exact"


def _req(task_id: str, answer: str, truth: str = "5", sleep: float = 0.0) -> RewardRequest:
    return RewardRequest(task_id=task_id, data_source="test", solution_str=answer, ground_truth=truth,
                         extra_info={"sleep": sleep})


@pytest.fixture(scope="module")
def scorer():
    s = Reward(SCORER, timeout=1.0, num_procs=2)
    yield s
    s.close()


def test_scores_in_order(scorer: Reward) -> None:
    results = asyncio.run(scorer.score([_req("a", "5"), _req("b", "6", sleep=0.5), _req("c", " 5 ")]))
    assert [(r.task_id, r.score, r.error) for r in results] == [("a", 1.0, None), ("b", 0.0, None), ("c", 1.0, None)]
    assert results[1].seconds >= 0.5  # the time recorded covers the score itself (the scorer slept 0.5 s)


def test_timeout_kills_and_pool_survives(scorer: Reward) -> None:
    start = time.monotonic()
    slow, fast = asyncio.run(scorer.score([_req("slow", "5", sleep=30), _req("fast", "5")]))
    assert time.monotonic() - start < 15  # the 30 s scorer was killed, not waited for
    assert slow.score is None and slow.error == "reward timed out after 1s"
    assert 1.0 <= slow.seconds < 15  # recorded from submission to the kill at the 1 s timeout
    assert fast.score == 1.0 and fast.error is None
    # the killed worker was replaced: both workers score again
    again = asyncio.run(scorer.score([_req("n1", "5"), _req("n2", "4")]))
    assert [(r.score, r.error) for r in again] == [(1.0, None), (0.0, None)]
    assert scorer.stats()["timeouts"] >= 1


def test_raising_scorer_is_an_error_not_zero() -> None:
    s = Reward("tests.helpers_rewards:raising", timeout=5.0, num_procs=1)
    try:
        (r,) = asyncio.run(s.score([_req("x", "oops")]))
        assert r.score is None and r.error == "ValueError: cannot score 'oops'"
        assert not r.ok
    finally:
        s.close()


def test_crashing_worker_is_an_error() -> None:
    s = Reward("tests.helpers_rewards:crash", timeout=5.0, num_procs=1)
    try:
        (r,) = asyncio.run(s.score([_req("x", "5")]))
        assert r.score is None and r.error.startswith("ProcessExpired")
    finally:
        s.close()


def test_bad_spec_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match="reward.fn"):
        Reward("no_such_module_xyz:fn", timeout=1.0, num_procs=1)


@pytest.mark.integration
def test_reward_actor_on_ray() -> None:
    import ray

    from rayrl.actors.reward import RewardActor

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The actor's pool workers import tests.helpers_rewards, so the repo root must be on their path.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    try:
        actor = RewardActor.remote(SCORER, 1.0, 2)
        batch = [_req("ok", "5"), _req("wrong", "7"), _req("slow", "5", sleep=30)]
        # two callers at once: the async actor interleaves them
        refs = [actor.score.remote(batch), actor.score.remote([_req("other", "5")])]
        first, second = ray.get(refs, timeout=60)
        assert [(r.task_id, r.score) for r in first] == [("ok", 1.0), ("wrong", 0.0), ("slow", None)]
        assert first[2].error == "reward timed out after 1s"
        assert [(r.task_id, r.score, r.error) for r in second] == [("other", 1.0, None)]
        (after,) = ray.get(actor.score.remote([_req("after", "5")]), timeout=60)
        assert after.score == 1.0
        ray.get(actor.close.remote(), timeout=30)
    finally:
        ray.shutdown()
