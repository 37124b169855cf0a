"""RewardActor: the Ray actor over `rayrl.scoring.Reward`; its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.logs import to_file
from rayrl.scoring import Reward

RewardActor = ray.remote(max_concurrency=256)(to_file(Reward))
