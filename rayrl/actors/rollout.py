"""RolloutActor: the Ray actor over `rayrl.rollout.Rollout`; its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.logs import to_file
from rayrl.rollout import Rollout

RolloutActor = ray.remote(to_file(Rollout))
