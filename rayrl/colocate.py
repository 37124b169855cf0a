"""Engines and learners taking turns with a shared GPU's memory (`engine.sleep_level`, `learner.param_offload`,
`learner.optimizer_offload`), as verl's hybrid engine does. One step, from the driver:

    rollout (engines awake; the learner's parameters in CPU memory)
    -> to_training: engines sleep (KV cache freed; weights offloaded or discarded)
    -> train (the learner moves its parameters back for the update; the AdamW state visits for the step only)
    -> to_rollout: engines wake their weights -> weight sync -> learners offload -> engines wake their KV cache

Each returns step metrics: seconds per phase, and the GiB the GPU gained (free memory on learner rank 0's GPU
before and after, every process on it counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from rayrl.config import Config


def sleeping(cfg: Config) -> bool:
    return cfg.engine.sleep_level > 0


def _free_gib(actors, timeout: float) -> float:
    return ray.get(actors.learners[0].memory.remote(), timeout=timeout).get("free_gib", 0.0)


def to_training(cfg: Config, actors, level: int | None = None) -> dict[str, float]:
    """Engines give their memory to the learners (sleep mode)."""
    if not sleeping(cfg):
        return {}
    timeout = cfg.engine.sync_timeout + 60
    free0 = _free_gib(actors, timeout)
    t0 = time.perf_counter()
    ray.get([e.sleep.remote(level or cfg.engine.sleep_level) for e in actors.engines], timeout=timeout)
    return {"colocate/sleep_s": time.perf_counter() - t0,
            "colocate/sleep_freed_gib": _free_gib(actors, timeout) - free0}


def to_rollout(cfg: Config, actors, sync: Callable[[], float]) -> dict[str, float]:
    """Engines take the GPU back with the new weights: wake the weights, `sync()` (the weight sync: it needs the
    learner's parameters and the engines' weights on the GPU), offload the learners, wake the KV cache."""
    timeout = cfg.engine.sync_timeout + 60
    if not sleeping(cfg):
        sync_s = sync()
        moved = ray.get([ln.offload.remote() for ln in actors.learners], timeout=cfg.learner.timeout)
        return {"sync/seconds": sync_s, **_offload_metrics(moved)}
    t0 = time.perf_counter()
    ray.get([e.wake_up.remote(["weights"]) for e in actors.engines], timeout=timeout)
    wake_weights = time.perf_counter() - t0
    sync_s = sync()
    free0 = _free_gib(actors, timeout)
    moved = ray.get([ln.offload.remote() for ln in actors.learners], timeout=cfg.learner.timeout)
    free1 = _free_gib(actors, timeout)
    t1 = time.perf_counter()
    ray.get([e.wake_up.remote(["kv_cache"]) for e in actors.engines], timeout=timeout)
    return {"sync/seconds": sync_s, "colocate/wake_s": wake_weights + time.perf_counter() - t1,
            "colocate/offload_freed_gib": free1 - free0, **_offload_metrics(moved)}


def _offload_metrics(moved: list[list]) -> dict[str, float]:
    """The slowest rank's seconds of the learners' offload (empty without learner.param_offload)."""
    seconds = [sum(m.seconds for m in rank) for rank in moved if rank]
    return {"colocate/offload_s": max(seconds)} if seconds else {}
