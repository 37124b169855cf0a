"""Batched dispatch (issue 18): a rollout worker hands in finished trajectories and leases new tasks in one queue call,
for at most its free slots; what finishes while a lease waits in the queue for tasks is acked at once, without it.

The worker's real loop (`Rollout.run`) runs in-process against the real `TaskQueue` and the real `Gateway`
(gateway.enabled=false, no engine), each reached the way the worker reaches actors (`handle.method.remote(...)`).
The agents make no LLM call, so every trajectory is the recorded failure "the agent made no LLM call": what is tested
here is that each task comes back exactly once, and when.
"""

from __future__ import annotations

import asyncio
import pickle
import time

import httpx

from rayrl.config import load_config
from rayrl.gateway import Gateway
from rayrl.queue import TaskQueue
from rayrl.rollout import Rollout
from rayrl.types import Task, Trajectory
from tests.helpers import tiny_overrides
from tests.unit.test_overlong import Local

NO_CALL = "the agent made no LLM call: nothing to train on"
running: list[int] = [0, 0]  # episodes running now, the most at once (one test at a time, one event loop)
failed_once: set[str] = set()


async def sleeps(ctx, config: dict) -> dict:
    """Sleeps `config["seconds"]` (`config["slow"]` for tasks whose id ends in /0), counting episodes at once."""
    running[0] += 1
    running[1] = max(running)
    try:
        await asyncio.sleep(config.get("slow", config["seconds"]) if ctx.task.task_id.endswith("/0")
                            else config["seconds"])
    finally:
        running[0] -= 1
    return {"reward": 1.0, "answer": "", "metadata": {}}


async def gateway_down_once(ctx, config: dict) -> dict:
    """The first run of each task fails as if the Gateway had died (an infrastructure failure: run again)."""
    if ctx.task.task_id not in failed_once:
        failed_once.add(ctx.task.task_id)
        raise httpx.ConnectError("connection refused", request=httpx.Request("POST", "http://127.0.0.1:1/"))
    return {"reward": 1.0, "answer": "", "metadata": {}}


async def blocks(ctx, config: dict) -> dict:
    """Holds the worker's event loop for `config["block"]` s (CPU work in an agent), then yields to it."""
    time.sleep(config["block"])
    await asyncio.sleep(0.1)
    return {"reward": 1.0, "answer": "", "metadata": {}}


def tasks(n: int) -> list[Task]:
    return [Task(task_id=f"s0/p{i}/{i % 4}", group_id=f"s0/p{i}", step=0, messages=[{"role": "user", "content": "q"}],
                 ground_truth="1", data_source="t") for i in range(n)]


def worker(tiny_model, queue: TaskQueue, agent: str, concurrency: int, **agent_config) -> Rollout:
    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "rollout.agent": f"tests.unit.test_rollout_dispatch:{agent}", "gateway.enabled": "false",
        "rollout.concurrency": concurrency, "rollout.infra_retry_delay": 0.05,
        **{f"rollout.agent_config.{k}": v for k, v in agent_config.items()}}))
    return Rollout("rollout/0.0", cfg, Local(queue), Local(Gateway(cfg, tiny_model, engines=[])), None)


async def collect(queue: TaskQueue, n: int, timeout: float) -> list[Trajectory]:
    """The driver's side: every result, unpacked as it arrives over Ray (the worker sends them pickled: queue.pack)."""
    got: list[Trajectory] = []
    end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        got += pickle.loads(pickle.dumps(await queue.get_results(n, 0.2, n - len(got))))
    return got


def test_a_worker_acks_and_leases_in_batches_within_its_free_slots(tiny_model):
    async def go():
        queue = TaskQueue()
        await queue.put(tasks(200))
        w = worker(tiny_model, queue, "sleeps", concurrency=16, seconds=0.02)
        running[:] = [0, 0]
        run = asyncio.create_task(w.run())
        try:
            return await collect(queue, 200, timeout=30), await queue.stats(), w
        finally:
            run.cancel()

    got, stats, w = asyncio.run(go())
    assert sorted(t.task_id for t in got) == sorted(t.task_id for t in tasks(200))  # each once
    assert {t.error for t in got} == {NO_CALL} and {t.worker for t in got} == {"rollout/0.0"}
    assert running[1] == 16  # every slot used, never more
    assert stats["leased"] == 0 and stats["completed_total"] == 200 and stats["duplicates_total"] == 0
    # per task, it would be a lease and an ack each: 400 calls; batched, a call carries a wave of 16
    assert stats["calls_total"] < 200 / 4, stats
    # the episodes that start (end) together open (close) their Gateway sessions in one call (rayrl.coalesce)
    assert w._open.batches < 200 / 4 and w._close.batches < 200 / 4, (w._open.batches, w._close.batches)
    assert w.gateway.obj.stats()["open_sessions"] == 0  # every session opened was closed


def test_what_finishes_while_a_lease_waits_in_the_queue_is_acked_at_once(tiny_model):
    """Fewer tasks than slots: the next lease waits in the queue (up to 1 s) for more; the results of the tasks
    running meanwhile must not wait for it."""

    async def go():
        queue = TaskQueue()
        await queue.put(tasks(3))
        w = worker(tiny_model, queue, "sleeps", concurrency=8, seconds=0.05, slow=0.3)
        run = asyncio.create_task(w.run())
        try:
            t0 = time.monotonic()
            fast = await collect(queue, 2, timeout=5)
            t_fast = time.monotonic() - t0
            slow = await collect(queue, 1, timeout=5)
            return fast, slow, t_fast, time.monotonic() - t0
        finally:
            run.cancel()

    fast, slow, t_fast, t_slow = asyncio.run(go())
    assert sorted(t.task_id for t in fast) == ["s0/p1/1", "s0/p2/2"] and [t.task_id for t in slow] == ["s0/p0/0"]
    assert t_fast < 0.6 and 0.3 <= t_slow < 0.9, (t_fast, t_slow)  # the lease waits 1 s in the queue


def test_an_infrastructure_failure_still_sends_the_task_back_to_be_run_again(tiny_model):
    async def go():
        queue = TaskQueue()
        await queue.put(tasks(20))
        w = worker(tiny_model, queue, "gateway_down_once", concurrency=8)
        failed_once.clear()
        run = asyncio.create_task(w.run())
        try:
            return await collect(queue, 20, timeout=30), await queue.stats()
        finally:
            run.cancel()

    got, stats = asyncio.run(go())
    assert sorted(t.task_id for t in got) == sorted(t.task_id for t in tasks(20))
    assert {t.error for t in got} == {NO_CALL}  # the second run's outcome, not the Gateway's failure
    assert stats["retried_total"] == 20 and stats["completed_total"] == 20 and stats["leased"] == 0


def test_each_trajectory_reports_how_late_the_workers_event_loop_woke_up(tiny_model):
    """An agent that holds the loop for 0.3 s delays everything else on the worker (the other episodes' LLM and
    sandbox calls): its trajectories say so; those of agents that only await do not."""

    async def go(agent: str, **agent_config) -> list[Trajectory]:
        queue = TaskQueue()
        await queue.put(tasks(4))
        run = asyncio.create_task(worker(tiny_model, queue, agent, concurrency=2, **agent_config).run())
        try:
            return await collect(queue, 4, timeout=30)
        finally:
            run.cancel()

    blocked = asyncio.run(go("blocks", block=0.3))
    free = asyncio.run(go("sleeps", seconds=0.3))
    assert len(blocked) == len(free) == 4
    assert all(t.timings["loop_lag_max"] >= 0.25 for t in blocked), [t.timings for t in blocked]
    assert all(t.timings["loop_lag_max"] < 0.15 for t in free), [t.timings for t in free]
