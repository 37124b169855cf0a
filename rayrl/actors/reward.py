"""RewardActor: the Ray actor over `rayrl.scoring.Reward`."""

import ray

from rayrl.scoring import Reward

RewardActor = ray.remote(max_concurrency=256)(Reward)
