"""MpsActor: the Ray shell over `rayrl.mps.MpsDaemon`, one per node whose GPUs the engines and learners share
(`placement.mps`). Its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.logs import to_file
from rayrl.mps import MpsDaemon

MpsActor = ray.remote(num_cpus=0)(to_file(MpsDaemon))
