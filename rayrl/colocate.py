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

import math
import time
from collections.abc import Callable

import ray

from rayrl import checkpoint, recovery
from rayrl.config import Config


def sleeping(cfg: Config) -> bool:
    return cfg.engine.sleep_level > 0


def warm_up_beside_rollout(cfg: Config) -> bool:
    """Whether the driver starts the learners' compile (`Learner.warm_up`) beside the first rollout: compiled GPU
    learners that keep their memory between steps. Not beside sleeping engines or with offloaded parameters (the
    learner's GPU memory belongs to the engine while it generates), not on CPU (the compile takes the rollout's
    cores: 120.7 s against 51.5 s for a first step on 2 cores)."""
    lc = cfg.learner
    compiled = lc.compile is not False  # None: on for GPU learners
    return compiled and lc.gpus_per_worker > 0 and not (sleeping(cfg) or lc.param_offload)


def _kept(cfg: Config, actors, call: str):
    """A learner rank that dies in `call` stops the run (rayrl.recovery.LearnerLost)."""
    return recovery.learners_kept(actors.learners, f"the learners' {call}", cfg.trainer.output_dir)


def _offload(cfg: Config, actors) -> list:
    with _kept(cfg, actors, "offload"):
        return ray.get([ln.offload.remote() for ln in actors.learners], timeout=cfg.learner.timeout)


def _free_gib(cfg: Config, actors, timeout: float) -> float:
    with _kept(cfg, actors, "memory query"):
        return ray.get(actors.learners[0].memory.remote(), timeout=timeout).get("free_gib", 0.0)


def to_training(cfg: Config, actors, level: int | None = None) -> dict[str, float]:
    """Engines give their memory to the learners (sleep mode)."""
    if not sleeping(cfg):
        return {}
    timeout = cfg.engine.sync_timeout + 60
    free0 = _free_gib(cfg, actors, timeout)
    t0 = time.perf_counter()
    ray.get([e.sleep.remote(level or cfg.engine.sleep_level) for e in actors.engines], timeout=timeout)
    return {"colocate/sleep_s": time.perf_counter() - t0,
            "colocate/sleep_freed_gib": _free_gib(cfg, actors, timeout) - free0}


def to_rollout(cfg: Config, actors, sync: Callable[[], float]) -> dict[str, float]:
    """Engines take the GPU back with the new weights: wake the weights, `sync()` (the weight sync: it needs the
    learner's parameters and the engines' weights on the GPU), offload the learners, wake the KV cache."""
    timeout = cfg.engine.sync_timeout + 60
    if not sleeping(cfg):
        sync_s = sync()
        moved = _offload(cfg, actors)
        return {"sync/seconds": sync_s, **_offload_metrics(moved)}
    t0 = time.perf_counter()
    ray.get([e.wake_up.remote(["weights"]) for e in actors.engines], timeout=timeout)
    wake_weights = time.perf_counter() - t0
    sync_s = sync()
    free0 = _free_gib(cfg, actors, timeout)
    moved = _offload(cfg, actors)
    free1 = _free_gib(cfg, actors, timeout)
    t1 = time.perf_counter()
    ray.get([e.wake_up.remote(["kv_cache"]) for e in actors.engines], timeout=timeout)
    return {"sync/seconds": sync_s, "colocate/wake_s": wake_weights + time.perf_counter() - t1,
            "colocate/offload_freed_gib": free1 - free0, **_offload_metrics(moved)}


def _offload_metrics(moved: list[list]) -> dict[str, float]:
    """The slowest rank's seconds of the learners' offload (empty without learner.param_offload)."""
    seconds = [sum(m.seconds for m in rank) for rank in moved if rank]
    return {"colocate/offload_s": max(seconds)} if seconds else {}


def host_memory_warning(cfg: Config, shapes: list[tuple[int, ...]], nodes: list[dict]) -> str | None:
    """Before the actors start: a warning line when what offload and sleep mode keep in a GPU node's CPU memory
    comes near the memory Ray sees there (`shapes`: the model's parameter shapes, rayrl.models.param_shapes;
    `nodes`: ray.nodes()). An OS that runs out kills a learner or an engine without a Python error: on the H200
    host a 7B shape's AdamW state, pinned tensor by tensor, took the host to 116 GiB of 125, and with the engine's
    weights kept as well (sleep level 1) the process was SIGKILLed (bench/gpu/results/2026-12-05).
    Per learner rank (FSDP shards dimension 0 over the ranks): the AdamW state, 8 bytes a parameter
    (rayrl.offload.PinnedCopies: no rounding to speak of); the parameters, 4 bytes each, every tensor rounded up
    to a power of two (torch's pinned allocator), twice with a KL reference model; with trainer.async_save the
    checkpoint's staged copy, 12 bytes a parameter (fp32 weights and AdamW's two moments). Per engine at sleep
    level 1: its weights in the model's dtype, rounded the same way (vLLM keeps them pinned)."""
    lc, e = cfg.learner, cfg.engine
    if (not (lc.param_offload or lc.optimizer_offload or e.sleep_level == 1 or cfg.trainer.async_save)
            or lc.gpus_per_worker <= 0):
        return None
    from rayrl.offload import pow2  # torch: only where offload or sleep is on

    world = lc.num_workers
    local = [math.ceil(s[0] / world) * math.prod(s[1:]) if s else 1 for s in shapes]  # a rank's shard of each
    parts = {}
    if lc.optimizer_offload:
        parts["learner.optimizer_offload"] = 8 * sum(local)
    if lc.param_offload:
        parts["learner.param_offload"] = sum(pow2(4 * n) for n in local) * (2 if cfg.algo.use_kl_loss else 1)
    if cfg.trainer.async_save:
        parts["trainer.async_save"] = checkpoint.BYTES_PER_PARAM * sum(local)
    per_rank = sum(parts.values())
    engine_bytes = 0
    if e.sleep_level == 1:
        size = 4 if cfg.model.dtype == "float32" else 2
        engine_bytes = sum(pow2(size * math.prod(s)) for s in shapes)
    worst = None
    for node in nodes:
        res = node.get("Resources", {})
        gpus = res.get("GPU", 0.0)
        if not node.get("Alive", True) or not gpus:
            continue
        ranks = min(world, int(gpus / lc.gpus_per_worker + 1e-9))
        engines = min(e.num_engines, int(gpus / e.gpus_per_engine + 1e-9)) if e.gpus_per_engine > 0 else 0
        need = ranks * per_rank + engines * engine_bytes
        have = res.get("memory", 0.0) + res.get("object_store_memory", 0.0)
        if have and (worst is None or need / have > worst[0]):
            worst = (need / have, node.get("NodeManagerAddress", "?"), ranks, engines, need, have)
    if worst is None or worst[0] < 0.9:
        return None
    _, addr, ranks, engines, need, have = worst
    gb = 1e9
    what = [f"{name} ~{ranks * b / gb:.1f} GB" for name, b in parts.items()]
    if engine_bytes and engines:
        what.append(f"engine.sleep_level=1 ~{engines * engine_bytes / gb:.1f} GB of engine weights")
    return (f"rayrl: warning: CPU memory of node {addr} ({ranks} learner rank(s), {engines} engine(s)): "
            f"{' + '.join(what)} = ~{need / gb:.0f} GB, against the ~{have / gb:.0f} GB Ray sees there; an OS "
            "out of memory kills a learner or engine (it shows as a SIGKILL). engine.sleep_level=2 drops the "
            "engines' copy; more learner ranks (learner.num_workers) spread the rest")
