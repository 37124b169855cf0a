"""EngineActor: the Ray actor over `rayrl.engine.Engine`; its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.engine import Engine
from rayrl.logs import to_file

EngineActor = ray.remote(to_file(Engine))
