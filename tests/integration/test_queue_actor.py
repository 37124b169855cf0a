"""TaskQueueActor on a real local Ray: blocking lease/get, timeouts, a killed worker, lease expiry."""

from __future__ import annotations

import sys
import time

import pytest
import ray
from ray import cloudpickle

from rayrl.actors.queue import TaskQueueActor
from rayrl.queue import pack
from rayrl.types import Task, Trajectory

pytestmark = pytest.mark.integration

# Ray workers cannot import a test module by name: ship the Worker class below by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def task(i: int) -> Task:
    return Task(task_id=f"s0/p{i}/0", group_id=f"s0/p{i}", step=0,
                messages=[{"role": "user", "content": f"q{i}"}], ground_truth=i, data_source="t")


def result(t: Task, worker: str) -> Trajectory:
    return Trajectory(task_id=t.task_id, group_id=t.group_id, step=t.step, data_source=t.data_source,
                      reward=1.0, worker=worker)


@ray.remote(num_cpus=0)
class Worker:
    """A rollout worker stand-in: leases tasks and, unless told to stall, acks a result for each (packed)."""

    def __init__(self, queue, worker_id: str):
        self.queue, self.worker_id = queue, worker_id

    def lease_and_stall(self, n: int) -> list[str]:
        got = ray.get(self.queue.lease.remote(self.worker_id, n, 10.0), timeout=30)
        return [t.task_id for _, t in got]

    def run(self, n_tasks: int, idle_timeout: float = 2.0) -> int:
        done, results = 0, []
        while True:
            accepted, got = ray.get(self.queue.ack_and_lease.remote(self.worker_id, pack(results), 4, idle_timeout),
                                    timeout=30)
            done += accepted
            if not got:
                return done
            results = [result(t, self.worker_id) for _, t in got]


def test_blocking_lease_returns_when_a_put_arrives() -> None:
    q = TaskQueueActor.remote()
    ref = q.lease.remote("w1", 1, 20.0)
    time.sleep(0.5)
    assert ray.wait([ref], timeout=0)[0] == []  # still parked
    t0 = time.monotonic()
    assert ray.get(q.put.remote([task(0)]), timeout=10) == 1
    got = ray.get(ref, timeout=10)
    assert time.monotonic() - t0 < 2.0
    assert [t.task_id for _, t in got] == [task(0).task_id]
    # Results block the same way.
    ref = q.get_results.remote(10, 20.0)
    time.sleep(0.3)
    assert ray.get(q.ack.remote("w1", [result(task(0), "w1")]), timeout=10) == 1
    assert [r.task_id for r in ray.get(ref, timeout=10)] == [task(0).task_id]
    ray.kill(q)


def test_timeouts_return_empty_after_about_the_timeout() -> None:
    q = TaskQueueActor.remote()
    ray.get(q.stats.remote(), timeout=30)  # actor up
    t0 = time.monotonic()
    assert ray.get(q.lease.remote("w1", 8, 0.5), timeout=10) == []
    assert 0.45 <= time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert ray.get(q.get_results.remote(8, 0.5), timeout=10) == []
    assert 0.45 <= time.monotonic() - t0 < 2.0
    # min_items not reached: whatever is there comes back at the timeout.
    ray.get(q.put.remote([task(1)]))
    (_, t), = ray.get(q.lease.remote("w1", 1))
    ray.get(q.ack.remote("w1", [result(t, "w1")]))
    t0 = time.monotonic()
    assert len(ray.get(q.get_results.remote(8, 0.5, min_items=2), timeout=10)) == 1
    assert time.monotonic() - t0 >= 0.45
    ray.kill(q)


def test_killed_worker_leases_are_released_and_finished_once_by_another() -> None:
    q = TaskQueueActor.remote()
    tasks = [task(i) for i in range(20)]
    assert ray.get(q.put.remote(pack(tasks)), timeout=30) == 20
    doomed = Worker.remote(q, "doomed")
    held = ray.get(doomed.lease_and_stall.remote(5), timeout=60)
    assert len(held) == 5
    ray.kill(doomed)
    # The driver notices the death (here: the kill) and gives the leases back.
    assert ray.get(q.release_worker.remote("doomed"), timeout=10) == 5
    assert ray.get(q.stats.remote())["pending"] == 20
    survivor = Worker.remote(q, "survivor")
    assert ray.get(survivor.run.remote(20, idle_timeout=1.0), timeout=60) == 20
    res = ray.get(q.get_results.remote(100, 5.0, min_items=20), timeout=10)
    assert sorted(r.task_id for r in res) == sorted(t.task_id for t in tasks)  # each exactly once
    assert all(type(r) is Trajectory for r in res)  # packed by the worker, plain objects here
    assert {r.worker for r in res} == {"survivor"}
    s = ray.get(q.stats.remote())
    assert (s["pending"], s["leased"], s["completed_total"], s["requeued_total"]) == (0, 0, 20, 5)
    ray.kill(survivor)
    ray.kill(q)


def test_parked_lease_of_a_released_worker_takes_nothing() -> None:
    q = TaskQueueActor.remote()
    ray.get(q.stats.remote(), timeout=30)  # actor up, so the lease below is parked before the release
    ref = q.lease.remote("gone", 1, 20.0)
    time.sleep(0.3)
    ray.get(q.release_worker.remote("gone"), timeout=10)
    ray.get(q.put.remote([task(0)]), timeout=10)
    assert ray.get(ref, timeout=10) == []
    assert ray.get(q.stats.remote())["pending"] == 1
    ray.kill(q)


def test_lease_expires_in_the_actor() -> None:
    q = TaskQueueActor.remote(lease_timeout=0.5, expire_interval=0.1)
    ray.get(q.put.remote([task(0)]), timeout=30)
    (_, t), = ray.get(q.lease.remote("slow", 1))
    # A second worker parks; the background expiry re-queues the lease and wakes it.
    t0 = time.monotonic()
    (_, t2), = ray.get(q.lease.remote("fast", 1, 10.0), timeout=15)
    assert t2.task_id == t.task_id and time.monotonic() - t0 < 3.0
    assert ray.get(q.ack.remote("fast", [result(t2, "fast")])) == 1
    assert ray.get(q.ack.remote("slow", [result(t, "slow")])) == 0  # the late one is a duplicate
    res = ray.get(q.get_results.remote(10, 1.0))
    assert [r.worker for r in res] == ["fast"]
    s = ray.get(q.stats.remote())
    assert (s["requeued_total"], s["duplicates_total"], s["completed_total"]) == (1, 1, 1)
    ray.kill(q)
