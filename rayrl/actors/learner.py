"""LearnerActor: the Ray actor over `rayrl.learner.Learner`; its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.learner import Learner
from rayrl.logs import to_file

LearnerActor = ray.remote(to_file(Learner))
