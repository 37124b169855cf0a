"""Dispatch at scale: the queue + driver overhead of a step of 8,192 trajectories, 16 rollout workers, no LLM.

Everything but the LLM is the production path: the driver's `Feeder.fill` and `collect` (rayrl.train), the
TaskQueueActor, and 16 RolloutActors running `Rollout.run` (batched: `ack_and_lease`) and `Rollout.run_task` for
each episode. The agent is fake: it sleeps a time fixed by its task id (uniform in [--min-s, --max-s]) and returns a
reward. Its Gateway session is opened and closed in the worker's own process (`NoLLMGateway`: a one-turn record, no
actor call), so what the step spends beyond its agents is the queue's, the driver's and the worker's own dispatch.

Overhead per step = wall time of the step (fill + collect) - the agents' critical path: the makespan of the same
sleeps put on the same slots (workers x rollout.concurrency) in queue order by a dispatcher that costs nothing. It is
printed as a share of a 60 s step (target <= 1%). The peer, in the same run with steps alternating: `PerTaskRollout`,
the worker loop rayrl had before (d8723ce): leases for its free slots, then each episode acks alone (per-task acks).

    python bench/dispatch_sim.py                                  # 8192 x 3 steps per mode, 16 workers x 256 slots
    python bench/dispatch_sim.py --trajectories 1024 --steps 2    # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import os
import statistics
import sys
import time
import types
import zlib

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Only what a rollout worker loads anyway: the workers import this module for `fake_agent`. The driver's modules
# (rayrl.train, rayrl.cluster: verl) are imported in `main`.
from rayrl.rollout import Rollout  # noqa: E402
from rayrl.types import SessionRecord, Turn  # noqa: E402

STEP_S = 60.0  # the step the overhead is a share of
TARGET = 0.01


def agent_seconds(task_id: str, lo: float, hi: float) -> float:
    """The fake agent's sleep for a task: fixed by its id, so the driver knows the agents' critical path."""
    return lo + (hi - lo) * zlib.crc32(task_id.encode()) / 2**32


async def fake_agent(ctx, config: dict) -> dict:
    """No LLM: sleeps, then returns a reward; its span (wall clock) says when the agent ran."""
    w0 = time.time()
    await asyncio.sleep(agent_seconds(ctx.task.task_id, config["min_s"], config["max_s"]))
    return {"reward": 1.0, "answer": "", "metadata": {"events": [{"name": "agent", "start": w0, "end": time.time()}]}}


async def _open_sessions(requests: list[dict]) -> list[tuple[str, str, str]]:
    # never called: the agent makes no LLM call
    return [(r["task_id"], "key", f"http://127.0.0.1:1/sessions/{r['task_id']}/v1") for r in requests]


async def _close_sessions(session_ids: list[str]) -> list[SessionRecord]:
    ids = list(range(8))
    return [SessionRecord(sid, sid, prompt_ids=ids, response_ids=ids, loss_mask=[1] * 8, logprobs=[-0.5] * 8,
                          versions=[0] * 8, num_turns=1, finish_reason="stop",
                          turns=[Turn(env_len=0, token_ids=ids, logprobs=[-0.5] * 8, finish_reason="stop", engine=0)])
            for sid in session_ids]


class NoLLMGateway:
    """The two Gateway calls a worker makes (per batch of episodes), answered in the worker's process
    (`handle.method.remote`)."""

    open_sessions = types.SimpleNamespace(remote=_open_sessions)
    close_sessions = types.SimpleNamespace(remote=_close_sessions)


class PerTaskRollout(Rollout):
    """The peer: rayrl's worker loop before batched dispatch (d8723ce), the episode path unchanged."""

    async def run(self) -> None:
        inflight: set[asyncio.Task] = set()
        while True:
            free = self.cfg.rollout.concurrency - len(inflight)
            if free == 0:
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            leases = await self.queue.lease.remote(self.worker_id, free, 1.0)
            for _, task in leases:
                t = asyncio.create_task(self._one(task))
                inflight.add(t)
                t.add_done_callback(inflight.discard)

    async def _one(self, task) -> None:
        await self.queue.ack.remote(self.worker_id, [await self.run_task(task)])


def critical_path(seconds: list[float], slots: int) -> float:
    """Makespan of `seconds` in order on `slots` slots, each task to the first free slot, dispatch free."""
    free = [0.0] * min(slots, len(seconds))
    for s in seconds:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def _cpu(_actor) -> float:
    return time.process_time()


class Mode:
    """One dispatch loop under test: its own queue, workers and driver state (Feeder), stepped by `step`."""

    def __init__(self, name: str, worker_cls, cfg, args):
        from rayrl.actors.queue import TaskQueueActor
        from rayrl.cluster import Actors
        from rayrl.data import DataIterator, Row
        from rayrl.recovery import Watch
        from rayrl.train import Feeder

        self.name, self.cfg, self.args = name, cfg, args
        r = cfg.rollout
        self.queue = TaskQueueActor.options(num_cpus=0).remote(lease_timeout=r.lease_timeout)
        # as cluster.start_worker starts them, without the placement group
        self.workers = [worker_cls.options(num_cpus=0.25, max_concurrency=r.concurrency + 8).remote(
            f"rollout/{i}.0", cfg, self.queue, NoLLMGateway(), None) for i in range(r.num_workers)]
        self.cpu(timeout=600)  # every worker started (each imports rayrl.rollout: seconds on a busy machine)
        self.actors = Actors(queue=self.queue, reward=None, workers=self.workers,
                             runs=[w.run.remote() for w in self.workers], generation=[0] * r.num_workers,
                             watch=Watch({"queue": self.queue}, cfg.trainer.recover_timeout))
        self.actors.watch.poll(wait=60)
        prompts = [Row(messages=[{"role": "user", "content": f"What is {i} + {i}?"}], ground_truth=str(2 * i),
                       data_source="sim") for i in range(cfg.trainer.batch_size)]
        self.feeder = Feeder(cfg, self.queue, DataIterator(prompts, cfg.trainer.batch_size, 0, shuffle=False), 0)
        self.step_no = 0
        self.rows: list[dict] = []

    def cpu(self, timeout: float = 60) -> tuple[float, float]:
        """CPU seconds so far of the queue actor's process and of the workers' processes together."""
        q, *w = ray.get([a.__ray_call__.remote(_cpu) for a in [self.queue, *self.workers]], timeout=timeout)
        return q, sum(w)

    def step(self, timed: bool) -> None:
        from rayrl.train import collect

        a, cfg = self.args, self.cfg
        q0, w0 = self.cpu()
        calls0 = ray.get(self.queue.stats.remote(), timeout=60)["calls_total"]
        d0, t0, wall0 = time.process_time(), time.perf_counter(), time.time()
        self.feeder.fill(until=self.step_no, version=0)
        t_fill = time.perf_counter() - t0
        expected = self.feeder.expected.pop(self.step_no)
        trajs = collect(cfg, self.actors, expected, self.step_no, self.feeder.early, self.feeder)
        wall, wall1, d_cpu = time.perf_counter() - t0, time.time(), time.process_time() - d0
        q1, w1 = self.cpu()
        calls = ray.get(self.queue.stats.remote(), timeout=60)["calls_total"] - calls0
        self.step_no += 1
        assert len(trajs) == len(expected) and all(t.ok for t in trajs), "a trajectory failed or is missing"
        ideal = critical_path([agent_seconds(tid, a.min_s, a.max_s) for tid in expected],
                              cfg.rollout.num_workers * cfg.rollout.concurrency)
        agent_end = max(e["end"] for t in trajs for e in t.events if e["name"] == "agent")
        agent_start = min(e["start"] for t in trajs for e in t.events if e["name"] == "agent")
        worker_s = statistics.mean(t.timings["total"] - agent_seconds(t.task_id, a.min_s, a.max_s) for t in trajs)
        row = {"wall": wall, "ideal": ideal, "over": wall - ideal, "fill": t_fill, "first": agent_start - wall0,
               "tail": wall1 - agent_end, "queue_cpu": q1 - q0, "driver_cpu": d_cpu, "workers_cpu": w1 - w0,
               "calls": calls / len(trajs), "episode_ms": 1000 * worker_s}
        print(f"{self.name:>9} step {self.step_no}{'' if timed else ' (warm-up)'}: wall {wall:6.2f} s, critical "
              f"path {ideal:6.2f} s, overhead {row['over']:5.2f} s = {row['over'] / STEP_S:6.2%} of {STEP_S:.0f} s | "
              f"fill {t_fill:.2f} s, first agent at {row['first']:.2f} s, last result {row['tail']:.2f} s after "
              f"the last agent | CPU s: queue {row['queue_cpu']:.2f}, driver {d_cpu:.2f}, workers "
              f"{row['workers_cpu']:.2f} | {row['calls']:.2f} queue calls/trajectory, "
              f"{row['episode_ms']:.1f} ms/episode in the worker beyond the agent", flush=True)
        if timed:
            self.rows.append(row)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rows)


def main() -> int:
    from rayrl.actors.rollout import RolloutActor
    from rayrl.cluster import private_token
    from rayrl.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=8192, help="per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=256, help="episodes in flight per worker")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up step each")
    ap.add_argument("--min-s", type=float, default=2.0, help="shortest agent sleep")
    ap.add_argument("--max-s", type=float, default=6.0, help="longest agent sleep")
    ap.add_argument("--modes", default="batched,per-task")
    args = ap.parse_args()
    if args.trajectories % args.n:
        ap.error(f"--trajectories ({args.trajectories}) must be divisible by --n ({args.n})")
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "rollout.agent": "bench.dispatch_sim:fake_agent", "rollout.agent_config.min_s": args.min_s,
        "rollout.agent_config.max_s": args.max_s, "rollout.n": args.n, "rollout.num_workers": args.workers,
        "rollout.concurrency": args.concurrency, "trainer.batch_size": args.trajectories // args.n}.items()])
    # Ray starts workers at nice 15; the driver runs at 0: the same priority for every process of the pipeline.
    private_token()  # no ~/.ray/auth_token left behind (rayrl.cluster)
    ray.init(num_cpus=max(8, args.workers), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}}, _system_config={"worker_niceness": 0})
    try:
        classes = {"batched": RolloutActor, "per-task": ray.remote(PerTaskRollout)}
        modes = [Mode(m, classes[m], cfg, args) for m in args.modes.split(",")]
        print(f"{args.trajectories} trajectories a step, {args.workers} workers x {args.concurrency} slots, agents "
              f"sleep {args.min_s}-{args.max_s} s; {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        for i in range(args.steps + 1):  # the modes take turns, step by step: the machine's load hits both alike
            for m in modes:
                m.step(timed=i > 0)
        print(f"\nmedians of {args.steps} steps | overhead s (share of a {STEP_S:.0f} s step) | fill s | last result "
              f"after the last agent s | queue / driver / workers CPU s | queue calls per trajectory")
        for m in modes:
            over = m.median("over")
            print(f"{m.name:>9}: {over:.2f} s ({over / STEP_S:.2%}, target <= {TARGET:.0%}: "
                  f"{'PASS' if over / STEP_S <= TARGET else 'FAIL'}) | {m.median('fill'):.2f} | "
                  f"{m.median('tail'):.2f} | {m.median('queue_cpu'):.2f} / {m.median('driver_cpu'):.2f} / "
                  f"{m.median('workers_cpu'):.2f} | {m.median('calls'):.2f}")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
