"""EngineActor: the Ray actor over `rayrl.engine.Engine`."""

import ray

from rayrl.engine import Engine

EngineActor = ray.remote(Engine)
