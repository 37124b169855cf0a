"""LeaseQueue logic and the TaskQueue around it, without Ray: leases, expiry, dead workers, duplicates, result order,
parked callers."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rayrl.queue import LeaseQueue, Packed, TaskQueue, _leases_out, _Unpacked, pack
from rayrl.types import Task, Trajectory


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def task(i: int) -> Task:
    return Task(task_id=f"s0/p{i}/0", group_id=f"s0/p{i}", step=0,
                messages=[{"role": "user", "content": f"q{i}"}], ground_truth=i, data_source="t")


def result(t: Task, worker: str = "") -> Trajectory:
    return Trajectory(task_id=t.task_id, group_id=t.group_id, step=t.step, data_source=t.data_source,
                      reward=1.0, worker=worker)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def q(clock: FakeClock) -> LeaseQueue:
    return LeaseQueue(lease_timeout=10.0, clock=clock)


def test_lease_ack_roundtrip(q: LeaseQueue) -> None:
    tasks = [task(i) for i in range(3)]
    assert q.put(tasks) == 3
    got = q.lease("w1")
    assert len(got) == 1
    lease_id, t = got[0]
    assert t.task_id == tasks[0].task_id and lease_id.startswith("w1#")
    assert q.stats()["leased"] == 1 and q.stats()["pending"] == 2
    assert q.ack("w1", [result(t, "w1")]) == 1
    assert [r.task_id for r in q.take_results(10)] == [tasks[0].task_id]
    s = q.stats()
    assert (s["pending"], s["leased"], s["done"], s["completed_total"]) == (2, 0, 0, 1)


def test_batch_lease_is_fifo_and_bounded(q: LeaseQueue) -> None:
    tasks = [task(i) for i in range(5)]
    q.put(tasks)
    a = q.lease("w1", max_items=3)
    b = q.lease("w2", max_items=3)
    assert [t.task_id for _, t in a] == [t.task_id for t in tasks[:3]]
    assert [t.task_id for _, t in b] == [t.task_id for t in tasks[3:]]
    assert q.lease("w3", max_items=3) == []
    assert len({lid for lid, _ in a + b}) == 5
    with pytest.raises(ValueError, match="max_items"):
        q.lease("w1", max_items=0)


def test_expired_lease_is_requeued_at_front(q: LeaseQueue, clock: FakeClock) -> None:
    tasks = [task(i) for i in range(3)]
    q.put(tasks)
    (_, t0), = q.lease("w1")
    clock.now += 9.9
    assert q.expire() == 0
    clock.now += 0.2
    s = q.stats()  # stats() expires lazily too
    assert (s["pending"], s["leased"], s["requeued_total"]) == (3, 0, 1)
    (_, again), = q.lease("w2")
    assert again.task_id == t0.task_id  # the re-queued task goes first


def test_release_worker_requeues_its_leases_in_order(q: LeaseQueue) -> None:
    tasks = [task(i) for i in range(5)]
    q.put(tasks)
    dead = q.lease("dead", max_items=2)
    alive = q.lease("alive", max_items=1)
    assert q.release_worker("dead") == 2
    assert q.release_worker("dead") == 0
    assert q.release_worker("never-seen") == 0
    s = q.stats()
    assert (s["pending"], s["leased"], s["requeued_total"]) == (4, 1, 2)
    got = q.lease("w2", max_items=10)
    assert [t.task_id for _, t in got] == [t.task_id for _, t in dead] + [t.task_id for t in tasks[3:]]
    # The live worker's lease is untouched.
    assert q.ack("alive", [result(alive[0][1])]) == 1


def test_task_finished_twice_after_expiry_is_counted_once(q: LeaseQueue, clock: FakeClock) -> None:
    t = task(0)
    q.put([t])
    q.lease("slow")
    clock.now += 11
    (_, t2), = q.lease("fast")  # expired and re-leased
    assert t2.task_id == t.task_id
    assert q.ack("fast", [result(t, "fast")]) == 1
    assert q.ack("slow", [result(t, "slow")]) == 0  # the late finisher is a duplicate
    res = q.take_results(10)
    assert [r.worker for r in res] == ["fast"]
    s = q.stats()
    assert (s["completed_total"], s["duplicates_total"], s["leased"], s["pending"]) == (1, 1, 0, 0)


def test_late_ack_first_wins_and_cancels_the_new_lease(q: LeaseQueue, clock: FakeClock) -> None:
    t = task(0)
    q.put([t])
    q.lease("slow")
    clock.now += 11
    q.lease("fast")
    assert q.ack("slow", [result(t, "slow")]) == 1  # the expired holder finishes first: accepted
    assert q.stats()["leased"] == 0
    assert q.ack("fast", [result(t, "fast")]) == 0
    assert [r.worker for r in q.take_results(10)] == ["slow"]


def test_ack_of_expired_lease_still_pending_removes_the_pending_copy(q: LeaseQueue, clock: FakeClock) -> None:
    t = task(0)
    q.put([t, task(1)])
    q.lease("slow")
    clock.now += 11
    assert q.expire() == 1
    assert q.ack("slow", [result(t, "slow")]) == 1
    s = q.stats()
    assert (s["pending"], s["done"]) == (1, 1)
    (_, nxt), = q.lease("w2")
    assert nxt.task_id == task(1).task_id  # the finished task is not handed out again


def test_duplicate_puts_are_ignored_and_counted(q: LeaseQueue) -> None:
    a, b = task(0), task(1)
    assert q.put([a, a, b]) == 2  # pending duplicate, in the same batch
    q.lease("w1")  # a is leased now
    assert q.put([a]) == 0  # leased duplicate
    q.ack("w1", [result(a)])
    assert q.put([a]) == 0  # completed duplicate
    assert q.stats()["duplicates_total"] == 3
    assert q.stats()["pending"] == 1


def test_results_are_fifo_and_take_is_bounded(q: LeaseQueue) -> None:
    tasks = [task(i) for i in range(6)]
    q.put(tasks)
    leased = q.lease("w1", max_items=6)
    order = [3, 0, 5, 1, 4, 2]
    for i in order:
        q.ack("w1", [result(leased[i][1])])
    first = q.take_results(4)
    rest = q.take_results(4)
    assert [r.task_id for r in first + rest] == [tasks[i].task_id for i in order]
    assert len(first) == 4 and len(rest) == 2 and q.take_results(4) == []


def test_unknown_result_is_rejected(q: LeaseQueue) -> None:
    assert q.ack("w1", [result(task(7))]) == 0
    s = q.stats()
    assert (s["rejected_total"], s["done"], s["completed_total"]) == (1, 0, 0)


def test_clear_pending_keeps_leases(q: LeaseQueue) -> None:
    tasks = [task(i) for i in range(4)]
    q.put(tasks)
    (_, t), = q.lease("w1")
    assert q.clear_pending() == 3
    assert q.lease("w2") == []
    assert q.ack("w1", [result(t)]) == 1  # the in-flight task still completes
    assert q.put(tasks[1:2]) == 1  # a dropped task may be put again


def test_stats_keys(q: LeaseQueue) -> None:
    assert set(q.stats()) >= {"pending", "leased", "done", "completed_total", "requeued_total", "duplicates_total"}
    assert all(isinstance(v, int) for v in q.stats().values())


def test_bad_lease_timeout() -> None:
    with pytest.raises(ValueError, match="lease_timeout must be > 0, got 0"):
        LeaseQueue(lease_timeout=0)


def test_items_without_task_id_are_a_clear_error(q: LeaseQueue) -> None:
    with pytest.raises(TypeError, match="put: items need a task_id .* got dict"):
        q.put([{"task_id": "x"}])
    with pytest.raises(TypeError, match="ack: items need a task_id"):
        q.ack("w1", ["x"])


def test_packed_items_cross_the_wire_as_bytes_and_arrive_as_objects(q: LeaseQueue) -> None:
    tasks = [task(i) for i in range(3)]
    # What the queue actor receives from put(pack(...)): Packed items, payloads still bytes.
    received = pickle.loads(pickle.dumps(pack(tasks), protocol=5))
    assert [type(x) for x in received] == [Packed] * 3
    assert [x.task_id for x in received] == [t.task_id for t in tasks]
    q.put(received + [task(3)])  # an unpacked item mixes in
    leased = q.lease("w1", max_items=4)
    # What the worker receives from the actor's lease(): plain (lease_id, Task) pairs.
    got = pickle.loads(pickle.dumps(_leases_out(leased), protocol=5))
    assert got == [(lid, t) for (lid, _), t in zip(leased, tasks + [task(3)], strict=True)]
    results = pickle.loads(pickle.dumps(pack([result(t, "w1") for t in tasks]), protocol=5))
    assert q.ack("w1", results + [result(task(3), "w1")]) == 4
    # What the driver receives from get_results(): plain Trajectories.
    out = pickle.loads(pickle.dumps(_Unpacked(q.take_results(10)), protocol=5))
    assert out == [result(t, "w1") for t in tasks + [task(3)]]


def test_pack_falls_back_to_cloudpickle() -> None:
    t = task(0)
    t.extra_info["check"] = lambda x: x + 1  # plain pickle cannot do this
    (p,) = pickle.loads(pickle.dumps(pack([t]), protocol=5))
    assert pickle.loads(p.blob).extra_info["check"](1) == 2


def test_task_queue_parks_callers_until_items_arrive() -> None:
    """TaskQueue, the TaskQueueActor's plain class, on a bare event loop: a parked lease wakes when a task is put,
    a parked get_results when its result is acked; with nothing coming, both return empty at their timeout."""

    async def scenario() -> None:
        tq = TaskQueue(lease_timeout=60.0)
        parked = asyncio.create_task(tq.lease("w1", 2, timeout=10.0))
        await asyncio.sleep(0.05)
        assert not parked.done()
        assert await tq.put([task(0)]) == 1
        [(lease_id, leased)] = await asyncio.wait_for(parked, 1.0)
        assert lease_id.startswith("w1#") and leased.task_id == task(0).task_id
        collecting = asyncio.create_task(tq.get_results(10, timeout=10.0))
        await asyncio.sleep(0.05)
        assert not collecting.done()
        assert await tq.ack("w1", [result(leased, "w1")]) == 1
        assert [r.task_id for r in await asyncio.wait_for(collecting, 1.0)] == [task(0).task_id]
        assert await tq.lease("w1", 1, timeout=0.1) == [] and await tq.get_results(1, timeout=0.1) == []

    asyncio.run(scenario())


def test_retry_waits_a_backoff_then_leases_again_up_to_the_cap(q: LeaseQueue, clock: FakeClock) -> None:
    t = task(0)
    q.put([t])
    [(_, got)] = q.lease("w1")
    assert q.retry("w1", [got.task_id], max_retries=2, delay=5.0) == []
    s = q.stats()
    assert (s["pending"], s["leased"], s["delayed"], s["retried_total"]) == (0, 0, 1, 1)
    assert q.lease("w2") == []  # still waiting out its back-off
    clock.now += 5.0
    [(_, again)] = q.lease("w2")
    assert again.task_id == t.task_id
    assert q.retry("w2", [t.task_id], max_retries=2, delay=5.0) == []
    clock.now += 9.9
    assert q.lease("w1") == []  # the second back-off is twice the first
    clock.now += 0.1
    [(_, third)] = q.lease("w1")
    # past the cap the task stays leased to its worker, which acks it as a failed trajectory
    assert q.retry("w1", [t.task_id], max_retries=2, delay=5.0) == [t.task_id]
    assert q.stats()["leased"] == 1
    assert q.ack("w1", [result(t, "w1")]) == 1
    assert q.stats()["retried_total"] == 2 and [r.task_id for r in q.take_results(5)] == [t.task_id]


def test_retry_refuses_tasks_the_worker_does_not_hold(q: LeaseQueue) -> None:
    a, b = task(0), task(1)
    q.put([a, b])
    q.lease("w1")
    assert q.retry("w2", [a.task_id], max_retries=3, delay=1.0) == [a.task_id]  # leased by w1, not w2
    assert q.retry("w1", [b.task_id], max_retries=3, delay=1.0) == [b.task_id]  # pending, not leased
    assert q.stats()["retried_total"] == 0


def test_a_retried_task_is_never_doubled(q: LeaseQueue, clock: FakeClock) -> None:
    """While it waits, a put of the same id is a duplicate and a late ack completes it (once)."""
    t = task(0)
    q.put([t])
    q.lease("w1")
    q.retry("w1", [t.task_id], max_retries=3, delay=5.0)
    assert q.put([t]) == 0
    assert q.ack("w9", [result(t, "w9")]) == 1  # e.g. an expired lease's worker finishing late
    clock.now += 60
    assert q.lease("w2") == [] and q.stats()["delayed"] == 0
    assert q.ack("w2", [result(t, "w2")]) == 0 and q.stats()["completed_total"] == 1


def test_clear_pending_drops_retried_tasks_too(q: LeaseQueue, clock: FakeClock) -> None:
    q.put([task(0), task(1)])
    [(_, t0)] = q.lease("w1")
    q.retry("w1", [t0.task_id], max_retries=3, delay=5.0)
    assert q.clear_pending() == 2
    clock.now += 60
    assert q.lease("w1") == [] and q.stats()["delayed"] == 0


def test_task_queue_counts_the_workers_calls_an_ack_and_lease_as_one() -> None:
    async def scenario() -> dict:
        tq = TaskQueue()
        await tq.put([task(i) for i in range(4)])
        got = await tq.lease("w1", 2)
        _, more = await tq.ack_and_lease("w1", pack([result(t) for _, t in got]), 2)
        await tq.ack("w1", pack([result(t) for _, t in more]))
        await tq.get_results(10)  # the driver's calls are not counted
        return await tq.stats()

    s = asyncio.run(scenario())
    assert (s["calls_total"], s["completed_total"], s["leased"]) == (3, 4, 0)
