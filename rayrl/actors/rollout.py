"""RolloutActor: the Ray actor over `rayrl.rollout.Rollout`."""

import ray

from rayrl.rollout import Rollout

RolloutActor = ray.remote(Rollout)
