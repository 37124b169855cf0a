"""Connect to Ray and start one actor group per role: queue, engines, reward, learners, rollout workers.

Actors are named by role and index (`rayrl/engine/0`, ...) so the Dashboard's Actors view reads like
the architecture.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

import ray

from rayrl.actors.engine import EngineActor
from rayrl.actors.learner import LearnerWorker
from rayrl.actors.queue import TaskQueue
from rayrl.actors.reward import RewardActor
from rayrl.actors.rollout import RolloutActor
from rayrl.config import Config


def connect(cfg: Config) -> None:
    """Join the cluster `ray job submit` runs us in (RAY_ADDRESS), the one named in the config, or start a local one."""
    if ray.is_initialized():
        return
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    # Actors mostly wait on each other: a local cluster gets more CPU slots than cores.
    num_cpus = None if address else (cfg.trainer.ray_num_cpus or max(8, 4 * (os.cpu_count() or 2)))
    ray.init(address=address, num_cpus=num_cpus, namespace=f"rayrl-{cfg.trainer.experiment_name}-{uuid.uuid4().hex[:6]}",
             include_dashboard=None if address else False, log_to_driver=True,
             runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "1"}} if not address else None)


@dataclass
class Actors:
    queue: object
    reward: object
    engines: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    runs: list = field(default_factory=list)  # each worker's run() ref; it resolves when the worker stops or dies
    generation: list = field(default_factory=list)  # restarts per worker slot, for unique names


def _threads(gpus: float) -> dict:
    # Ray sets OMP_NUM_THREADS=1 in workers; a CPU engine or learner should use every core while it runs.
    return {} if gpus > 0 else {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}}}


def start(cfg: Config, model_path: str) -> Actors:
    queue = TaskQueue.options(name="rayrl/queue", num_cpus=0).remote(lease_timeout=cfg.rollout.lease_timeout)
    reward = RewardActor.options(name="rayrl/reward/0", num_cpus=0.5).remote(
        cfg.reward.fn, cfg.reward.timeout, cfg.reward.num_procs)
    e = cfg.engine
    engines = [EngineActor.options(name=f"rayrl/engine/{i}", num_cpus=1, num_gpus=e.gpus_per_engine, max_concurrency=1000,
                                   **_threads(e.gpus_per_engine))
               .remote(model_path, e, cfg.model.dtype, cfg.trainer.seed + i, f"engine/{i}") for i in range(e.num_engines)]
    lc = cfg.learner
    learners = [LearnerWorker.options(name=f"rayrl/learner/{r}", num_cpus=1, num_gpus=lc.gpus_per_worker,
                                      **_threads(lc.gpus_per_worker)).remote(model_path, cfg, r, lc.num_workers)
                for r in range(lc.num_workers)]
    # Engines and learners load in parallel; the learners rendezvous at rank 0's address.
    starts = [eng.start.remote() for eng in engines]
    addr, port = ray.get(learners[0].address.remote(), timeout=120)
    ray.get([ln.setup.remote(addr, port) for ln in learners] + starts, timeout=e.sync_timeout + 600)
    actors = Actors(queue=queue, reward=reward, engines=engines, learners=learners)
    for i in range(cfg.rollout.num_workers):
        actors.generation.append(0)
        actors.workers.append(None)
        actors.runs.append(None)
        start_worker(actors, cfg, model_path, i)
    return actors


def start_worker(actors: Actors, cfg: Config, model_path: str, i: int) -> None:
    gen = actors.generation[i]
    w = RolloutActor.options(name=f"rayrl/rollout/{i}" + (f".{gen}" if gen else ""), num_cpus=0.25,
                             max_concurrency=cfg.rollout.concurrency + 8).remote(
        f"rollout/{i}.{gen}", cfg, model_path, actors.queue, actors.engines, actors.reward)
    actors.workers[i] = w
    actors.runs[i] = w.run.remote()


def restart_dead_workers(actors: Actors, cfg: Config, model_path: str) -> list[str]:
    """A worker whose run() ended (it died) gets its leases re-queued at once and is replaced. Returns their ids."""
    done, _ = ray.wait(actors.runs, num_returns=len(actors.runs), timeout=0)
    dead = []
    for i, ref in enumerate(actors.runs):
        if ref in done:
            wid = f"rollout/{i}.{actors.generation[i]}"
            ray.get(actors.queue.release_worker.remote(wid), timeout=30)
            actors.generation[i] += 1
            start_worker(actors, cfg, model_path, i)
            dead.append(wid)
    return dead


def shutdown(actors: Actors | None) -> None:
    """Stop engines cleanly (their engine-core subprocesses with them), then kill every actor."""
    if actors is None:
        return
    try:
        ray.get([e.shutdown.remote() for e in actors.engines] + [ln.shutdown.remote() for ln in actors.learners],
                timeout=30)
    except Exception:  # noqa: BLE001 - dying anyway; the kills below still run
        pass
    for a in [actors.queue, actors.reward, *actors.engines, *actors.learners, *actors.workers]:
        if a is not None:
            ray.kill(a, no_restart=True)
