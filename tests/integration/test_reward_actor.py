"""The RewardActor on a local Ray: two callers at once, a timed-out score recorded, the actor scoring after it."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, reward_request

pytestmark = pytest.mark.integration

SCORER = "tests.helpers:slow_or_exact"


def test_reward_actor_on_ray() -> None:
    import ray

    from rayrl.actors.reward import RewardActor

    # The actor's pool workers import tests.helpers, so the repo root must be on their path.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        actor = RewardActor.remote(SCORER, 1.0, 2)
        batch = [reward_request("ok", "5"), reward_request("wrong", "7"), reward_request("slow", "5", sleep=30)]
        # two callers at once: the async actor interleaves them
        refs = [actor.score.remote(batch), actor.score.remote([reward_request("other", "5")])]
        first, second = ray.get(refs, timeout=60)
        assert [(r.task_id, r.score) for r in first] == [("ok", 1.0), ("wrong", 0.0), ("slow", None)]
        assert first[2].error == "reward timed out after 1s"
        assert [(r.task_id, r.score, r.error) for r in second] == [("other", 1.0, None)]
        (after,) = ray.get(actor.score.remote([reward_request("after", "5")]), timeout=60)
        assert after.score == 1.0
        ray.get(actor.close.remote(), timeout=30)
    finally:
        ray.shutdown()
