"""Connect to Ray and start one actor group per role: queue, engines, reward, learners, rollout workers, and
(when `sandbox.num_actors` > 0) shared code sandboxes.

Actors are named by role and index (`rayrl/engine/0`, ...) so the Dashboard's Actors view reads like
the architecture. Each role gets one placement group with a bundle per actor (`placement.*`): the
strategy spreads or packs them over however many nodes the cluster has, and a role's custom resources
pin it to the nodes that offer them. The queue (no CPU) stays on the driver's node. Engines and learners that
each take a fraction of a GPU are colocated instead: one placement group `rayrl/gpu` with a bundle per GPU, learner
rank r in bundle r with the engines that load from it (see `colocated`, `gpu_bundles`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayrl import logs, mps, recovery, stop, weight_sync
from rayrl.actors.engine import EngineActor
from rayrl.actors.gateway import GatewayActor
from rayrl.actors.learner import LearnerActor
from rayrl.actors.mps import MpsActor
from rayrl.actors.queue import TaskQueueActor
from rayrl.actors.reward import RewardActor
from rayrl.actors.rollout import RolloutActor
from rayrl.actors.sandbox import SandboxActor
from rayrl.config import Config


def connect(cfg: Config) -> None:
    """Join the cluster `ray job submit` runs us in (RAY_ADDRESS), the one named in the config, or start a local one;
    then SIGTERM and SIGINT raise `rayrl.stop.Stopped`."""
    if ray.is_initialized():
        return
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address and not _reachable(address):
        source = "trainer.ray_address" if cfg.trainer.ray_address else "RAY_ADDRESS"
        raise ConnectionError(f"no Ray cluster at {address} (from {source}); "
                              "start one with `ray start --head`, or unset it to run on a local Ray")
    # Actors mostly wait on each other: a local cluster gets more CPU slots than cores.
    num_cpus = None if address else (cfg.trainer.ray_num_cpus or max(8, 4 * (os.cpu_count() or 2)))
    if not address:
        private_token()
    if not cfg.trainer.verbose:
        logs.divert_raylet_errors(logs.log_dir(cfg.trainer.output_dir, False))
    namespace = f"rayrl-{cfg.trainer.experiment_name}-{uuid.uuid4().hex[:6]}"
    ray.init(address=address, num_cpus=num_cpus, namespace=namespace,
             include_dashboard=None if address else False, log_to_driver=cfg.trainer.verbose,
             runtime_env=logs.runtime_env(cfg.trainer.output_dir, cfg.trainer.verbose, local=not address))
    stop.install()  # after ray.init, which replaces SIGTERM's handler: a stop now unwinds the driver (rayrl.stop)


def private_token() -> None:
    """Before `ray.init` starts a local cluster. Ray turns token auth on for one and writes ~/.ray/auth_token, which
    then switches auth on for a later `ray start --head` and breaks a `ray job submit` from a shell without
    RAY_AUTH_MODE=token. This keeps auth on with a token of the cluster's own, in its processes' environment only
    (nothing is changed where the environment already chose)."""
    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        ray._raylet.Config.initialize("")  # re-read by this process (Ray caches its config at import)


def _reachable(address: str) -> bool:
    """False if `address` is host:port and nothing listens there (ray.init would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or "://" in address:
        return True  # "auto", "local", ray://...: leave it to Ray
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return True
    except OSError:
        return False


@dataclass
class Actors:
    queue: object
    reward: object
    engines: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    sandboxes: list = field(default_factory=list)  # shared SandboxActors (sandbox.num_actors), handed to every worker
    runs: list = field(default_factory=list)  # each worker's run() ref; it resolves when the worker stops or dies
    generation: list = field(default_factory=list)  # restarts per worker slot, for unique names
    groups: dict = field(default_factory=dict)  # role -> its placement group
    # the OpenAI-compatible HTTP fronts of the engines (gateway.num_gateways); each records its sessions' calls
    gateways: list = field(default_factory=list)
    weight_sync: str = "object_store"  # engine.weight_sync resolved at start: object_store | cuda_ipc | broadcast
    gateway_ports: list = field(default_factory=list)  # where each listens: a restarted Gateway listens there again
    watch: object = None  # rayrl.recovery.Watch over the actors Ray restarts (queue, reward, engines, Gateway...)
    mps: list = field(default_factory=list)  # placement.mps: an MpsActor per node of the engines and learners

    def gateway(self, worker: int):
        """The Gateway rollout worker `worker` and its sessions use."""
        return self.gateways[worker % len(self.gateways)]


# NVLink multicast off in NCCL, PyTorch and NVSHMEM: on shared multi-GPU hosts a program that uses it can put
# the host's GPUs out of service. Every actor gets these unless the job's runtime_env or the driver sets them.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _env(all_cores: bool = False, extra: dict | None = None) -> dict:
    """An actor's runtime_env: MULTICAST_OFF, and for CPU engines and learners (`all_cores`) OMP_NUM_THREADS = every
    core (Ray sets 1 in workers), and `extra` (the MPS client's). A value in the job's runtime_env wins: it is left
    out here."""
    job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    env = {k: os.environ.get(k, v) for k, v in MULTICAST_OFF.items()} | (extra or {})
    if all_cores:
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    env = {k: v for k, v in env.items() if k not in job_env}
    return {"runtime_env": {"env_vars": env}} if env else {}


def reserve(cfg: Config) -> dict:
    """One placement group per role, one bundle per actor; waits until the cluster fits them all."""
    p, e, lc, r = cfg.placement, cfg.engine, cfg.learner, cfg.rollout
    roles = {"engine": (e.num_engines, {"CPU": 1, "GPU": e.gpus_per_engine}, p.engine_resources),
             "learner": (lc.num_workers, {"CPU": 1, "GPU": lc.gpus_per_worker}, p.learner_resources),
             "reward": (1, {"CPU": 0.5}, p.reward_resources),
             "rollout": (r.num_workers, {"CPU": 0.25}, p.rollout_resources)}
    if cfg.sandbox.num_actors:
        roles["sandbox"] = (cfg.sandbox.num_actors, {"CPU": cfg.sandbox.cpus_per_actor}, p.sandbox_resources)
    if colocated(cfg):  # one bundle per GPU, shared by the learner rank and the engine(s) placed in it
        n = gpu_bundles(cfg)
        k = -(-e.num_engines // n)  # engines in a bundle
        extra = {x: k * p.engine_resources.get(x, 0) + p.learner_resources.get(x, 0)
                 for x in {**p.engine_resources, **p.learner_resources}}
        roles["gpu"] = (n, {"CPU": 1 + k, "GPU": 1}, extra)
        del roles["engine"], roles["learner"]
    groups, wanted = {}, {}
    for role, (n, res, extra) in roles.items():
        bundle = {k: v for k, v in {**res, **extra}.items() if v > 0}
        wanted[role] = f"{n} x {bundle}"
        groups[role] = placement_group([bundle] * n, strategy=p.strategy, name=f"rayrl/{role}")
    if "gpu" in groups:
        groups["engine"] = groups["learner"] = groups.pop("gpu")
    _wait_ready(groups, wanted, p)
    return groups


def _wait_ready(groups: dict, wanted: dict, p) -> None:
    """Until the cluster fits every placement group, or placement.timeout (then they are removed and it raises)."""
    try:
        ray.get([g.ready() for g in _unique(groups)], timeout=p.timeout)
    except ray.exceptions.GetTimeoutError:
        for g in _unique(groups):
            remove_placement_group(g)
        raise RuntimeError(f"the cluster cannot place the actors within placement.timeout={p.timeout}s "
                           f"(strategy {p.strategy}): wanted {wanted}; it has {ray.available_resources()}") from None


def colocated(cfg: Config) -> bool:
    """Engines and learners share GPUs when both take a fraction of one that fits next to the other (0.4 + 0.5):
    engine i then runs on learner rank i % ranks' GPU (cuda_ipc weight sync; see `gpu_bundles`). Otherwise each has GPUs
    of its own."""
    ge, gl = cfg.engine.gpus_per_engine, cfg.learner.gpus_per_worker
    return 0 < ge and 0 < gl and ge + gl <= 1


def gpu_bundles(cfg: Config) -> int:
    """Colocated: the GPUs of `rayrl/gpu`. One per learner rank when its engines fit on its GPU beside it (engine i
    on rank i % ranks, the rank `cuda_ipc.serving_rank` loads it from: two engines of 0.2 and a rank of 0.5 on one
    GPU); otherwise one per engine or rank, whichever are more, engine i beside rank i."""
    e, lc = cfg.engine, cfg.learner
    fits = -(-e.num_engines // lc.num_workers) * e.gpus_per_engine + lc.gpus_per_worker <= 1
    return lc.num_workers if fits else max(e.num_engines, lc.num_workers)


def engine_bundle(cfg: Config, i: int) -> int:
    """Engine i's bundle: its own in `rayrl/engine`, or, colocated, the GPU bundle it shares (see `gpu_bundles`)."""
    return i % gpu_bundles(cfg) if colocated(cfg) else i


def engine_placement(cfg: Config, groups: dict, i: int) -> dict:
    return _in(groups, "engine", engine_bundle(cfg, i))


def start_engines(cfg: Config, engines: list) -> list:
    """Each engine's start: all at once, except engines that may share a GPU, which start one after another. vLLM
    reads the GPU's free memory before and after its profiling run and fails if it grew meanwhile, as it does when a
    neighbour finishes its own start (or goes to sleep); with a fixed KV cache (engine.gpu_kv_cache_gb) it does not
    profile, and all start at once."""
    ge, last, starts = cfg.engine.gpus_per_engine, {}, []
    if cfg.engine.gpu_kv_cache_gb > 0:
        return [eng.start.remote(None) for eng in engines]
    for i, eng in enumerate(engines):
        # colocated: its GPU bundle; fractions of a GPU otherwise may be packed onto one GPU: all one after another
        gpu = engine_bundle(cfg, i) if colocated(cfg) or not 0 < ge < 1 else 0
        starts.append(eng.start.remote(last.get(gpu)))
        last[gpu] = starts[-1]
    return starts


def _unique(groups: dict) -> list:
    return list({g.id: g for g in groups.values()}.values())


def _in(groups: dict, role: str, i: int) -> dict:
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(groups[role], placement_group_bundle_index=i)}


# Ray restarts the actor for as long as the run lives; one that does not come back within trainer.recover_timeout
# stops the run (rayrl.recovery.RoleLost).
_RESTART = {"max_restarts": -1}


class ByName(list):
    """Actor handles that travel as their names and are looked up again where they arrive (in the job's namespace).
    A restartable actor gets its peers so: Ray cannot restore actor handles or object refs in the constructor arguments
    of an actor it restarts, and warns on the console for each such actor (ray-project/ray#53727)."""

    def __init__(self, names: list[str]):
        super().__init__(ray.get_actor(n) for n in names)
        self.names = names

    def __reduce__(self):
        return ByName, (self.names,)


def start_mps(cfg: Config, groups: dict) -> tuple[list, dict]:
    """placement.mps: a control daemon on every node that holds engines or learners, up before any of them starts
    (a CUDA process joins MPS when it first touches the GPU); returns the daemons and the environment that makes the
    engines and learners their clients."""
    if not cfg.placement.mps:
        return [], {}
    pipe_dir = f"/tmp/rayrl-mps-{uuid.uuid4().hex[:8]}"  # the run's own: nothing else on the host joins it
    gpu_roles = [r for r, gpus in (("engine", cfg.engine.gpus_per_engine), ("learner", cfg.learner.gpus_per_worker))
                 if gpus > 0]
    nodes = sorted({n for r in gpu_roles for n in ray.util.placement_group_table(groups[r])["bundles_to_node_id"]
                    .values()})
    daemons = [MpsActor.options(name=f"rayrl/mps/{i}", **_env(),
                                scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(pipe_dir)
               for i, n in enumerate(nodes)]
    try:
        ray.get([d.alive.remote() for d in daemons], timeout=120)  # each constructor returns once its daemon answers
    except BaseException:
        with contextlib.suppress(Exception):
            ray.get([d.stop.remote() for d in daemons], timeout=60)  # those that started
        for d in daemons:
            ray.kill(d)
        raise
    return daemons, mps.env(pipe_dir)


def mps_unjoined(actors: Actors) -> list[str]:
    """placement.mps, once the engines and learners hold their GPU memory: a warning line for each node whose daemon
    none of them joined (they then take turns on the GPU in time slices, as without MPS)."""
    joined = ray.get([d.clients.remote() for d in actors.mps], timeout=60)
    return [f"rayrl: placement.mps: no engine or learner joined the MPS daemon on node {node}; they share its GPU in "
            "time slices, as without MPS" for node, pids in joined if not pids]


def start(cfg: Config, model_path: str) -> Actors:
    groups = reserve(cfg)
    try:
        daemons, client = start_mps(cfg, groups)
    except BaseException:
        for g in _unique(groups):
            remove_placement_group(g)
        raise
    # Ray restarts these when they die (the driver finishes the job: rayrl.recovery); a call in flight on the
    # stateless reward and sandboxes is retried on the successor. A call in flight on the queue fails: its callers
    # carry on, the driver refills the successor from its ledger.
    queue = TaskQueueActor.options(name="rayrl/queue", num_cpus=0, **_env(), **_RESTART).remote(
        lease_timeout=cfg.rollout.lease_timeout)
    reward = RewardActor.options(name="rayrl/reward/0", num_cpus=0.5, **_in(groups, "reward", 0), **_env(), **_RESTART,
                                 max_task_retries=2,
                                 resources=cfg.placement.reward_resources).remote(
        cfg.reward.fn, cfg.reward.timeout, cfg.reward.num_procs)
    e = cfg.engine
    engines = [EngineActor.options(name=f"rayrl/engine/{i}", num_cpus=1, num_gpus=e.gpus_per_engine, **_RESTART,
                                   max_concurrency=1000, resources=cfg.placement.engine_resources,
                                   **engine_placement(cfg, groups, i),
                                   **_env(all_cores=e.gpus_per_engine == 0, extra=client))
               .remote(model_path, e, cfg.model.dtype, cfg.trainer.seed + i, f"engine/{i}")
               for i in range(e.num_engines)]
    learners = _learners(cfg, model_path, groups, cfg.learner.gpus_per_worker, client)
    sb = cfg.sandbox
    sandboxes = [SandboxActor.options(name=f"rayrl/sandbox/{i}", num_cpus=sb.cpus_per_actor, max_concurrency=1000,
                                      **_RESTART, max_task_retries=1,
                                      resources=cfg.placement.sandbox_resources, **_in(groups, "sandbox", i), **_env())
                 .remote(sb) for i in range(sb.num_actors)]
    if sb.warm:  # started beside the engines' load; a zygote that cannot start falls back inside the pool
        for actor in sandboxes:
            actor.warm.remote()
    actors = Actors(queue=queue, reward=reward, engines=engines, learners=learners, sandboxes=sandboxes, groups=groups,
                    mps=daemons)
    try:
        # Engines and learners load in parallel; the learners rendezvous at rank 0's address. Engines that sleep
        # (engine.sleep_level) start first, at their gpu_memory_utilization of a still empty GPU, then sleep (level 1:
        # their weights are kept for the first wake) while the learners load.
        starts = start_engines(cfg, engines)
        # Meanwhile the Gateway (it finds the engines by name) and the rollout workers, whose processes take seconds
        # to start (8 of them on a 16-core GPU host: created after the load, the first trajectory began 8.9 s into
        # step 1; created here, 0.8 s: bench/gpu/results/2026-12-05b and -05c); a worker only leases tasks, and the
        # driver puts none in the queue before the start returns.
        # The Gateways run on the driver's node (the head under `ray job submit`): their URLs are what agent services
        # use (each session's base_url names its Gateway).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        g = cfg.gateway
        actors.gateways = [GatewayActor.options(name=f"rayrl/gateway/{i}", num_cpus=0, max_concurrency=10000,
                                                **_env(), **_RESTART, scheduling_strategy=here).remote(
            cfg, model_path, ByName([f"rayrl/engine/{j}" for j in range(len(engines))]))
            for i in range(g.num_gateways)]
        listening = [gw.start.remote(port=g.port + i if g.port else 0) for i, gw in enumerate(actors.gateways)]
        for i in range(cfg.rollout.num_workers):
            actors.generation.append(0)
            actors.workers.append(None)
            actors.runs.append(None)
            start_worker(actors, cfg, i)
        if e.sleep_level:
            _get(starts, timeout=e.sync_timeout + 600)
            starts = [eng.sleep.remote(1) for eng in engines]
            _get(starts, timeout=e.sync_timeout + 60)
        addr, port = ray.get(learners[0].address.remote(), timeout=120)
        _get([ln.setup.remote(addr, port) for ln in learners] + starts, timeout=e.sync_timeout + 600)
        actors.weight_sync = weight_sync.connect(cfg, learners, engines)  # + its setup (broadcast: the group)
        urls = ray.get(listening, timeout=120)
        actors.gateway_ports = [int(u.rpartition(":")[2]) if g.enabled else None for u in urls]
        actors.watch = recovery.Watch({"queue": queue, "reward": reward,
                                       **{f"gateway/{i}": gw for i, gw in enumerate(actors.gateways)},
                                       **{f"engine/{i}": eng for i, eng in enumerate(engines)},
                                       **{f"sandbox/{i}": sbx for i, sbx in enumerate(sandboxes)}},
                                      cfg.trainer.recover_timeout)
        actors.watch.poll(wait=60)  # every pid, so that a later one differing is a restart
    except BaseException:
        shutdown(actors, starting=True)  # a failed or stopped start must not leave engines or placement groups behind
        raise
    return actors


def _get(refs: list, timeout: float) -> list:
    """ray.get of actors that load for minutes, in waits of a second: a Ctrl-C or SIGTERM then stops the start
    within one (a single ray.get took ~10 s to notice one on the 2-core machine: until the engines had loaded)."""
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, deadline - time.monotonic()))
        ray.get(ready)  # one that failed raises now, not after the others have loaded
    return ray.get(refs, timeout=max(deadline - time.monotonic(), 0.001))  # past the deadline: GetTimeoutError


def _learners(cfg: Config, model_path: str, groups: dict, gpus: float, client: dict | None = None) -> list:
    lc = cfg.learner
    return [LearnerActor.options(name=f"rayrl/learner/{r}", num_cpus=1, num_gpus=gpus,
                                 resources=cfg.placement.learner_resources, **_in(groups, "learner", r),
                                 **_env(all_cores=gpus == 0, extra=client))
            .remote(model_path, cfg, r, lc.num_workers)
            for r in range(lc.num_workers)]


def start_learners(cfg: Config, model_path: str) -> Actors:
    """The learner ranks alone (`rayrl sft`: no engines, queue, reward or rollout workers), set up and rendezvoused,
    in placement group `rayrl/learner`. Without an engine beside it, a rank takes a whole GPU where RL would share
    one (learner.gpus_per_worker < 1)."""
    lc, p = cfg.learner, cfg.placement
    gpus = float(-(-lc.gpus_per_worker // 1))  # 0 stays 0 (CPU); 0.5 -> 1
    bundle = {k: v for k, v in {"CPU": 1, "GPU": gpus, **p.learner_resources}.items() if v > 0}
    groups = {"learner": placement_group([bundle] * lc.num_workers, strategy=p.strategy, name="rayrl/learner")}
    _wait_ready(groups, {"learner": f"{lc.num_workers} x {bundle}"}, p)
    actors = Actors(queue=None, reward=None, groups=groups)
    try:
        actors.learners = _learners(cfg, model_path, groups, gpus)
        addr, port = ray.get(actors.learners[0].address.remote(), timeout=120)
        ray.get([ln.setup.remote(addr, port) for ln in actors.learners], timeout=lc.timeout)
    except BaseException:
        shutdown(actors)
        raise
    return actors


def worker_name(i: int, gen: int) -> str:
    """Rollout worker i's actor name; a replacement (generation `gen` > 0) gets a new one."""
    return f"rayrl/rollout/{i}" + (f".{gen}" if gen else "")


def start_worker(actors: Actors, cfg: Config, i: int) -> None:
    gen = actors.generation[i]
    w = RolloutActor.options(name=worker_name(i, gen), num_cpus=0.25, **_env(),
                             resources=cfg.placement.rollout_resources, **_in(actors.groups, "rollout", i),
                             max_concurrency=cfg.rollout.concurrency + 8).remote(
        f"rollout/{i}.{gen}", cfg, actors.queue, actors.gateway(i), actors.reward, actors.sandboxes)
    actors.workers[i] = w
    actors.runs[i] = w.run.remote()


def restart_dead_workers(actors: Actors, cfg: Config) -> list[str]:
    """A worker whose run() ended (it died) gets its leases re-queued at once and is replaced. Returns the dead
    workers' actor names."""
    done, _ = ray.wait(actors.runs, num_returns=len(actors.runs), timeout=0)
    dead = []
    for i, ref in enumerate(actors.runs):
        if ref in done:
            with contextlib.suppress(ray.exceptions.RayError):  # read: Ray prints an error never read as "Unhandled"
                ray.get(ref, timeout=10)
            wid = f"rollout/{i}.{actors.generation[i]}"
            try:
                ray.get(actors.queue.release_worker.remote(wid), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # the queue died too: its successor holds no lease of the dead worker
            dead.append(worker_name(i, actors.generation[i]))
            actors.generation[i] += 1
            start_worker(actors, cfg, i)
    return dead


def shutdown(actors: Actors | None, starting: bool = False) -> None:
    """Stop engines cleanly (their engine-core subprocesses with them, also mid-start), then kill every actor.
    `starting`: the learners may still be loading (a call to them would wait for that): they are only killed."""
    if actors is None:
        return
    learners = [] if starting else [ln.shutdown.remote() for ln in actors.learners]
    try:
        ray.get([e.shutdown.remote() for e in actors.engines] + learners
                + [s.close.remote() for s in actors.sandboxes], timeout=30)
    except Exception:  # noqa: BLE001 - dying anyway; the kills below still run
        pass
    for a in [*actors.workers, *actors.gateways, actors.reward, *actors.engines, *actors.learners, *actors.sandboxes,
              actors.queue]:
        if a is not None:
            ray.kill(a, no_restart=True)
    if actors.mps:  # after their clients: a daemon quits once they have gone
        with contextlib.suppress(Exception):
            ray.get([d.stop.remote() for d in actors.mps], timeout=90)
        for d in actors.mps:
            ray.kill(d)
    for g in _unique(actors.groups):
        remove_placement_group(g)
