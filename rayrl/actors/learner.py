"""LearnerActor: the Ray actor over `rayrl.learner.Learner`."""

import ray

from rayrl.learner import Learner

LearnerActor = ray.remote(Learner)
