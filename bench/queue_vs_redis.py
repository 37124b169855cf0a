"""Dispatch throughput: TaskQueue (Ray actor) against Redis LPUSH/BRPOP, side by side, same run.

Both sides have the same process topology and do the same work per task:
  driver   = producer thread (puts pickled-Task payloads) + collector thread (gets results)
  consumer = a separate process (a Ray actor / a multiprocessing process) that takes a task,
             builds a Trajectory for it and hands it back
  queue    = a separate process (the TaskQueue actor / redis-server)
Modes: one item per call, and batches of `--batch` per call. Throughput = tasks / (first put ... last result).

    python bench/queue_vs_redis.py                # 3000 one at a time, 30000 batched, best of 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from rayrl.actors.queue import TaskQueueActor
from rayrl.cluster import private_token
from rayrl.queue import pack
from rayrl.types import Task, Trajectory

TARGETS = {"single": 0.5, "batched": 1.0}  # TaskQueue / Redis
WAIT_S = 30.0  # every blocking call has a timeout: a stuck run fails instead of hanging


def make_tasks(prefix: str, n: int) -> list[Task]:
    return [Task(task_id=f"{prefix}/p{i}/0", group_id=f"{prefix}/p{i}", step=0,
                 messages=[{"role": "user", "content": f"What is {i} + {i + 1}?"}],
                 ground_truth=str(2 * i + 1), data_source="bench") for i in range(n)]


def result_for(t: Task, worker: str) -> Trajectory:
    return Trajectory(task_id=t.task_id, group_id=t.group_id, step=t.step, data_source=t.data_source,
                      reward=1.0, worker=worker)


def chunks(xs: list, size: int) -> list[list]:
    return [xs[i:i + size] for i in range(0, len(xs), size)]


@dataclass
class Run:
    backend: str
    mode: str
    n: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.n / self.seconds


def drive(put: Callable[[list[Task]], None], get: Callable[[], list], tasks: list[Task], batch: int) -> float:
    """Producer thread puts `tasks` in chunks of `batch` while this thread collects; returns the seconds."""
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for c in chunks(tasks, batch):
                put(c)
        except BaseException as e:  # noqa: BLE001 - surfaced below, not lost in the thread
            errors.append(e)

    seen: set[str] = set()
    t0 = time.perf_counter()
    producer = threading.Thread(target=produce)
    producer.start()
    while len(seen) < len(tasks):
        got = get()
        if not got:
            raise RuntimeError(f"no result within {WAIT_S}s after {len(seen)}/{len(tasks)}: {errors}")
        seen.update(r.task_id for r in got)
    dt = time.perf_counter() - t0
    producer.join()
    if errors:
        raise errors[0]
    if seen != {t.task_id for t in tasks}:
        raise RuntimeError("results do not match the tasks")
    return dt


# ---------------------------------------------------------------- TaskQueue


@ray.remote(num_cpus=0)
class Consumer:
    """Rollout-worker stand-in: hands in the previous results and leases the next tasks in one blocking call."""

    def __init__(self, queue, worker_id: str):
        self.queue, self.worker_id = queue, worker_id

    def run(self, n: int, batch: int) -> int:
        done, results = 0, []
        while done < n:
            accepted, got = ray.get(self.queue.ack_and_lease.remote(self.worker_id, pack(results), batch, WAIT_S),
                                    timeout=WAIT_S + 10)
            done += accepted
            results = [result_for(t, self.worker_id) for _, t in got]
            if not got and done < n:
                raise RuntimeError(f"{self.worker_id}: no task within {WAIT_S}s after {done}/{n}")
        return done


def bench_taskqueue(q, consumer, tasks: list[Task], warm: list[Task], batch: int) -> float:
    done = consumer.run.remote(len(warm) + len(tasks), batch)

    def put(c: list[Task]) -> None:
        ray.get(q.put.remote(pack(c)), timeout=WAIT_S)

    def get() -> list:
        return ray.get(q.get_results.remote(batch, WAIT_S), timeout=WAIT_S + 10)

    drive(put, get, warm, batch)  # same path, untimed: first-call costs out of the figure
    dt = drive(put, get, tasks, batch)
    ray.get(done, timeout=WAIT_S)
    return dt


# ---------------------------------------------------------------- Redis


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 6379:
            return port


def start_redis() -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: apt-get install -y redis-server")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    sys.exit(f"redis-server did not answer on port {port}")


def redis_consumer(port: int, n: int, batch: int, ready) -> None:
    """Consumer process: BRPOP a task (BLMPOP COUNT `batch` when batched), LPUSH its result."""
    import redis

    r = redis.Redis(port=port)
    r.ping()
    ready.set()
    done = 0
    while done < n:
        if batch == 1:
            got = r.brpop("tasks", timeout=WAIT_S)
            raw = [got[1]] if got else []
        else:
            got = r.blmpop(WAIT_S, 1, "tasks", direction="RIGHT", count=batch)
            raw = got[1] if got else []
        if not raw:
            raise RuntimeError(f"redis consumer: no task within {WAIT_S}s after {done}/{n}")
        results = [pickle.dumps(result_for(pickle.loads(b), "redis")) for b in raw]
        r.lpush("results", *results)
        done += len(raw)


def bench_redis(port: int, tasks: list[Task], warm: list[Task], batch: int) -> float:
    import redis

    ctx = mp.get_context("spawn")  # no fork of a process that runs Ray's threads
    ready = ctx.Event()
    proc = ctx.Process(target=redis_consumer, args=(port, len(warm) + len(tasks), batch, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.kill()
        raise RuntimeError("redis consumer did not start")
    prod, coll = redis.Redis(port=port), redis.Redis(port=port)  # one connection per thread

    def put(c: list[Task]) -> None:
        prod.lpush("tasks", *[pickle.dumps(t) for t in c])

    def get() -> list:
        if batch == 1:
            got = coll.brpop("results", timeout=WAIT_S)
            raw = [got[1]] if got else []
        else:
            got = coll.blmpop(WAIT_S, 1, "results", direction="RIGHT", count=batch)
            raw = got[1] if got else []
        return [pickle.loads(b) for b in raw]

    try:
        drive(put, get, warm, batch)
        dt = drive(put, get, tasks, batch)
    finally:
        proc.join(WAIT_S)
        if proc.is_alive():
            proc.kill()
    if proc.exitcode != 0:
        raise RuntimeError(f"redis consumer exited with {proc.exitcode}")
    return dt


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-single", type=int, default=3000, help="tasks in the one-at-a-time mode")
    ap.add_argument("--n-batched", type=int, default=30000, help="tasks in the batched mode")
    ap.add_argument("--batch", type=int, default=64, help="items per call in the batched mode")
    ap.add_argument("--repeats", type=int, default=3, help="runs per backend and mode; the best one counts")
    ap.add_argument("--modes", default="single,batched", help="comma-separated: single, batched")
    args = ap.parse_args()

    redis_proc, port = start_redis()
    runs: list[Run] = []
    try:
        # Ray starts its workers at nice 15; redis-server and the Redis consumer run at 0. Same priority
        # for both sides, or on a busy machine the TaskQueue side loses the CPU for a reason unrelated to it.
        private_token()  # no ~/.ray/auth_token left behind (rayrl.cluster)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _system_config={"worker_niceness": 0})
        q = TaskQueueActor.remote()
        consumer = Consumer.remote(q, "consumer-0")
        ray.get(q.stats.remote(), timeout=60)
        modes = [m for m in [("single", "one at a time", args.n_single, 1),
                             ("batched", f"batches of {args.batch}", args.n_batched, args.batch)]
                 if m[0] in args.modes.split(",")]
        for rep in range(args.repeats):
            for _, mode, n, batch in modes:
                warm = make_tasks(f"warm{rep}-{batch}", min(n, 20 * batch))
                tasks = make_tasks(f"run{rep}-{batch}", n)
                # Alternate which backend goes first, so drift on a shared machine hits both.
                order = ["taskqueue", "redis"] if rep % 2 == 0 else ["redis", "taskqueue"]
                for backend in order:
                    if backend == "taskqueue":
                        dt = bench_taskqueue(q, consumer, tasks, warm, batch)
                    else:
                        dt = bench_redis(port, tasks, warm, batch)
                    runs.append(Run(backend, mode, n, dt))
                    print(f"  rep {rep} {mode:14s} {backend:9s} {n / dt:10,.0f} items/s", flush=True)
    finally:
        ray.shutdown()
        redis_proc.kill()
        redis_proc.wait()

    print(f"\nbest of {args.repeats}; batched = {args.batch} items per call; {os.cpu_count()} cores")
    print("| mode | tasks | TaskQueue items/s | Redis items/s | TaskQueue/Redis | target | result |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for key, mode, n, _ in modes:
        best = {b: max(r.rate for r in runs if r.backend == b and r.mode == mode) for b in ("taskqueue", "redis")}
        ratio = best["taskqueue"] / best["redis"]
        passed = ratio >= TARGETS[key]
        ok &= passed
        print(f"| {mode} | {n} | {best['taskqueue']:,.0f} | {best['redis']:,.0f} | {ratio:.2f}x "
              f"| >= {TARGETS[key]}x | {'PASS' if passed else 'FAIL'} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
