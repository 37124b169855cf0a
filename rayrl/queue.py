"""TaskQueue: the task/result queue between the driver and the rollout workers (replaces Redis).

`LeaseQueue` is the bookkeeping, `TaskQueue` the async class that parks callers on it (both plain, tested
without Ray); `rayrl.actors.queue.TaskQueueActor` is its Ray actor.

A worker *leases* tasks rather than popping them: a lease that is not acked before its deadline,
or whose worker the driver reports dead (`release_worker`), goes back to the front of the queue. A task whose
episode failed for want of another actor (an engine, the Gateway... died: rayrl.recovery) is handed back with
`retry`: it waits a back-off, then is leased again; past `max_retries` the worker acks it as failed.
Results are keyed by `task_id`, so a task finished twice (an expired lease finished late *and*
by the re-leaser) is kept once: nothing is lost, nothing is counted twice.

Senders may wrap what they put/ack in `pack(...)`: each payload is pickled once by the sender and
kept as bytes by the queue actor, which then never (un)pickles a Task or Trajectory; receivers get
the plain objects back either way. Unpacked objects work too, at a higher cost per item.
"""

from __future__ import annotations

import asyncio
import heapq
import pickle
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

_MISSING = object()


class Packed:
    """One task or result as its task_id and its pickled bytes (see `pack`)."""

    __slots__ = ("task_id", "blob")

    def __init__(self, task_id: str, blob: bytes):
        self.task_id, self.blob = task_id, blob


def pack(items: list) -> list[Packed]:
    """Pickle each task/result once, on the sender's side, for `put` / `ack` / `ack_and_lease`.

    The queue actor keeps the bytes as they are and the receiver unpickles them: the queue's
    cost per item no longer grows with the payload (a Trajectory carries thousands of token ids).
    Only for arguments to the queue actor: anywhere else the items arrive as `Packed`.
    """
    return _PackedBatch(Packed(x.task_id, _dumps(x)) for x in items)


def _dumps(x: Any) -> bytes:
    try:
        return pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        # e.g. a lambda in extra_info: cloudpickle output loads with plain pickle.loads.
        return ray.cloudpickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)


class _PackedBatch(list):
    # Sent as two flat lists of str/bytes: pickle's C fast path, no Python call per item
    # (Ray's cloudpickle calls reducer_override for every other object).
    def __reduce__(self):
        return _as_packed, ([p.task_id for p in self], [p.blob for p in self])


def _as_packed(task_ids: list[str], blobs: list[bytes]) -> list[Packed]:
    return [Packed(t, b) for t, b in zip(task_ids, blobs, strict=True)]


class _Unpacked(list):
    """What the actor returns: a list whose Packed items arrive unpickled on the receiver's side."""

    def __init__(self, items: list, lease_ids: list[str] | None = None):
        super().__init__(items if lease_ids is None else zip(lease_ids, items, strict=True))
        self._lease_ids = lease_ids

    def __reduce__(self):
        items = self if self._lease_ids is None else [x for _, x in self]
        # Packed -> its bytes; an object put without pack() travels as itself (never bytes: it has a task_id).
        wire = [x.blob if type(x) is Packed else x for x in items]
        return _unpack_wire, (wire, self._lease_ids)


def _unpack_wire(wire: list, lease_ids: list[str] | None) -> list:
    items = [pickle.loads(x) if type(x) is bytes else x for x in wire]
    return items if lease_ids is None else list(zip(lease_ids, items, strict=True))


@dataclass(slots=True)
class Lease:
    lease_id: str
    worker_id: str
    item: Any
    deadline: float


class LeaseQueue:
    """Pending tasks, leases with deadlines, retried tasks waiting out a back-off, completed results. Every method is
    O(1) per item (`retry`: O(log n)).

    A task_id is in at most one of pending / leased / delayed / completed at any time.
    Items and results only need a `task_id` attribute (rayrl.types.Task / Trajectory).
    """

    def __init__(self, lease_timeout: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if lease_timeout <= 0:
            raise ValueError(f"lease_timeout must be > 0, got {lease_timeout}")
        self.lease_timeout = lease_timeout
        self._clock = clock
        self._pending: OrderedDict[str, Any] = OrderedDict()
        # One timeout for all leases and a monotonic clock, so insertion order is deadline order:
        # expire() only looks at the front.
        self._leased: OrderedDict[str, Lease] = OrderedDict()
        self._by_worker: dict[str, dict[str, None]] = {}  # worker_id -> its leased task ids, in order
        # Ids of every task completed in this queue's life: put() and ack() dedup against it.
        self._completed: set[str] = set()
        self._results: deque[Any] = deque()
        # Tasks handed back by `retry`, waiting out their back-off: task id -> item, and a heap of (ready time, id).
        self._delayed: dict[str, Any] = {}
        self._ready_at: list[tuple[float, str]] = []
        self._retries: dict[str, int] = {}  # task id -> times handed back by `retry`
        self._seq = 0
        self.completed_total = 0
        self.requeued_total = 0
        self.retried_total = 0
        self.duplicates_total = 0
        self.rejected_total = 0  # results for task ids this queue never held (or dropped by clear_pending)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_done(self) -> int:
        return len(self._results)

    def put(self, items: list) -> int:
        """Append tasks; a task_id already pending, leased or completed is ignored. Returns how many were added."""
        added = 0
        for item in items:
            tid = _task_id(item, "put")
            if tid in self._pending or tid in self._leased or tid in self._completed or tid in self._delayed:
                self.duplicates_total += 1
                continue
            self._pending[tid] = item
            added += 1
        return added

    def lease(self, worker_id: str, max_items: int = 1) -> list[tuple[str, Any]]:
        """Lease up to `max_items` tasks (oldest first) to `worker_id`; returns (lease_id, task) pairs."""
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.expire()
        if not self._pending:
            return []
        deadline = self._clock() + self.lease_timeout
        mine = self._by_worker.setdefault(worker_id, {})
        out = []
        while self._pending and len(out) < max_items:
            tid, item = self._pending.popitem(last=False)
            self._seq += 1
            lease_id = f"{worker_id}#{self._seq}"
            self._leased[tid] = Lease(lease_id, worker_id, item, deadline)
            mine[tid] = None
            out.append((lease_id, item))
        return out

    def ack(self, worker_id: str, results: list) -> int:
        """Complete the tasks these results belong to; returns how many were accepted.

        The first result for a task wins, whichever worker holds the lease now (the lease may have
        expired and gone to another worker); later results for it are dropped as duplicates.
        """
        accepted = 0
        for res in results:
            tid = _task_id(res, "ack")
            if tid in self._completed:
                self.duplicates_total += 1
                continue
            lease = self._leased.pop(tid, None)
            if lease is not None:
                self._unindex(lease.worker_id, tid)
            elif self._pending.pop(tid, _MISSING) is _MISSING and self._delayed.pop(tid, _MISSING) is _MISSING:
                # Never put, or dropped by clear_pending (a cancelled step): nobody wants it.
                self.rejected_total += 1
                continue
            self._completed.add(tid)
            self._retries.pop(tid, None)
            self._results.append(res)
            self.completed_total += 1
            accepted += 1
        return accepted

    def release_worker(self, worker_id: str) -> int:
        """Re-queue, at the front, every task leased by `worker_id` (it died). Returns how many."""
        tids = self._by_worker.pop(worker_id, None)
        if not tids:
            return 0
        self._requeue_front([(tid, self._leased.pop(tid).item) for tid in tids])
        return len(tids)

    def retry(self, worker_id: str, task_ids: list[str], max_retries: int, delay: float) -> list[str]:
        """Hand back leased tasks whose episode failed for want of another actor: each is leased again after
        `delay` x 2^(its retries so far) seconds. A task already retried `max_retries` times stays leased (the worker
        acks it as failed) and is in the returned list, as are ids `worker_id` does not hold."""
        refused = []
        now = self._clock()
        for tid in task_ids:
            lease = self._leased.get(tid)
            n = self._retries.get(tid, 0)
            if lease is None or lease.worker_id != worker_id or n >= max_retries:
                refused.append(tid)
                continue
            del self._leased[tid]
            self._unindex(worker_id, tid)
            self._retries[tid] = n + 1
            self._delayed[tid] = lease.item
            heapq.heappush(self._ready_at, (now + delay * 2**n, tid))
            self.retried_total += 1
        return refused

    def expire(self) -> int:
        """Re-queue, at the front, leases past their deadline, and at the back, retried tasks whose back-off is
        over. Returns how many leases expired."""
        now = self._clock()
        while self._ready_at and self._ready_at[0][0] <= now:
            tid = heapq.heappop(self._ready_at)[1]
            item = self._delayed.pop(tid, _MISSING)  # gone if a late ack completed it meanwhile
            if item is not _MISSING:
                self._pending[tid] = item
        expired = []
        while self._leased:
            tid, lease = next(iter(self._leased.items()))
            if lease.deadline > now:
                break
            self._leased.popitem(last=False)
            self._unindex(lease.worker_id, tid)
            expired.append((tid, lease.item))
        if expired:
            self._requeue_front(expired)
        return len(expired)

    def take_results(self, max_items: int) -> list:
        """Pop up to `max_items` completed results, oldest first."""
        n = min(max_items, len(self._results))
        return [self._results.popleft() for _ in range(n)]

    def stats(self) -> dict[str, int]:
        self.expire()
        return {
            "pending": len(self._pending),
            "leased": len(self._leased),
            "delayed": len(self._delayed),
            "done": len(self._results),
            "completed_total": self.completed_total,
            "requeued_total": self.requeued_total,
            "retried_total": self.retried_total,
            "duplicates_total": self.duplicates_total,
            "rejected_total": self.rejected_total,
        }

    def clear_pending(self) -> int:
        """Drop every pending task, retried ones waiting included (shutdown / step cancelled). Leased tasks stay
        leased. Returns how many."""
        n = len(self._pending) + len(self._delayed)
        self._pending.clear()
        self._delayed.clear()
        self._ready_at.clear()
        return n

    def _requeue_front(self, entries: list[tuple[str, Any]]) -> None:
        # Reversed, so the entries keep their order at the front.
        for tid, item in reversed(entries):
            self._pending[tid] = item
            self._pending.move_to_end(tid, last=False)
        self.requeued_total += len(entries)

    def _unindex(self, worker_id: str, tid: str) -> None:
        mine = self._by_worker[worker_id]
        del mine[tid]
        if not mine:
            del self._by_worker[worker_id]


def _task_id(x: Any, op: str) -> str:
    try:
        return x.task_id
    except AttributeError:
        raise TypeError(f"{op}: items need a task_id (a Task, a Trajectory or pack(...)), "
                        f"got {type(x).__name__}") from None


class _Waiters:
    """Callers parked until something arrives: a future each, woken oldest first, no polling."""

    def __init__(self) -> None:
        self._futs: deque[asyncio.Future] = deque()

    async def wait(self, timeout: float) -> None:
        """Return when woken or after `timeout` seconds, whichever comes first."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._futs.append(fut)
        timer = loop.call_later(timeout, _time_out, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if fut.cancelled() or fut.result() is _TIMED_OUT:
                # Drop it unless wake() already has, or idle workers polling with timeouts pile up futures.
                try:
                    self._futs.remove(fut)
                except ValueError:
                    pass

    def wake(self, n: int) -> None:
        """Wake up to `n` callers, oldest first."""
        while n > 0 and self._futs:
            fut = self._futs.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    def wake_all(self) -> None:
        self.wake(len(self._futs))


_TIMED_OUT = object()


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(_TIMED_OUT)


class TaskQueue:
    """Async front of `LeaseQueue` (run as `TaskQueueActor`): `lease` and `get_results` block up to `timeout` s
    without blocking other callers; a background task expires leases every `expire_interval` s.

    Workers call `ack_and_lease` (a batch of results in, a batch of tasks out: one round trip), `ack`, `lease` and
    `retry`; the driver calls `put`, `get_results`, `release_worker` (when it sees a worker actor die) and `stats`
    (`calls_total` counts the workers' calls: how well they batch).
    """

    def __init__(self, lease_timeout: float = 600.0, expire_interval: float = 1.0):
        self._q = LeaseQueue(lease_timeout)
        self._expire_interval = expire_interval
        self._leasers = _Waiters()
        self._collectors = _Waiters()
        # Bumped by release_worker: a lease call of that worker still parked then returns [] instead
        # of leasing tasks to a dead worker (they would sit there until the lease expired).
        self._epoch: dict[str, int] = {}
        self._ticker: asyncio.Task | None = None
        self._calls = 0

    async def put(self, items: list) -> int:
        self._start()
        n = self._q.put(items)
        self._wake_leasers()
        return n

    async def lease(self, worker_id: str, max_items: int = 1, timeout: float = 0.0) -> list[tuple[str, Any]]:
        """Lease up to `max_items` tasks, waiting up to `timeout` s for the first; [] on timeout."""
        self._calls += 1
        return await self._lease(worker_id, max_items, timeout)

    async def ack(self, worker_id: str, results: list) -> int:
        """Hand in results; returns how many were accepted (duplicates and unknown tasks are dropped)."""
        self._calls += 1
        return self._ack(worker_id, results)

    async def ack_and_lease(
        self, worker_id: str, results: list, max_items: int = 1, timeout: float = 0.0
    ) -> tuple[int, list[tuple[str, Any]]]:
        """`ack` then `lease` in one round trip: what a worker does between two batches of episodes."""
        self._calls += 1
        n = self._ack(worker_id, results)
        return n, await self._lease(worker_id, max_items, timeout)

    async def _lease(self, worker_id: str, max_items: int, timeout: float) -> list[tuple[str, Any]]:
        self._start()
        got = self._q.lease(worker_id, max_items)
        if got or timeout <= 0:
            return _leases_out(got)
        epoch = self._epoch.get(worker_id, 0)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            remaining = end - loop.time()
            if remaining <= 0:
                return []
            await self._leasers.wait(remaining)
            if self._epoch.get(worker_id, 0) != epoch:
                return []
            got = self._q.lease(worker_id, max_items)
            if got:
                # Woken for more items than this call took: pass the wake-up on.
                self._wake_leasers()
                return _leases_out(got)

    def _ack(self, worker_id: str, results: list) -> int:
        self._start()
        n = self._q.ack(worker_id, results)
        if n:
            self._collectors.wake_all()
        return n

    async def get_results(self, max_items: int, timeout: float = 0.0, min_items: int = 1) -> list:
        """Pop up to `max_items` results once `min_items` are waiting, or whatever is there after `timeout` s."""
        self._start()
        min_items = max(1, min(min_items, max_items))
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._q.num_done < min_items:
            remaining = end - loop.time()
            if remaining <= 0:
                break
            await self._collectors.wait(remaining)
        return _Unpacked(self._q.take_results(max_items))

    async def retry(self, worker_id: str, task_ids: list[str], max_retries: int, delay: float) -> list[str]:
        """`LeaseQueue.retry`: returns the ids not handed back (over `max_retries`: the worker acks them failed)."""
        self._start()
        self._calls += 1
        return self._q.retry(worker_id, task_ids, max_retries, delay)

    async def release_worker(self, worker_id: str) -> int:
        """Re-queue every lease of `worker_id` (the driver saw it die); returns how many."""
        self._start()
        self._epoch[worker_id] = self._epoch.get(worker_id, 0) + 1
        n = self._q.release_worker(worker_id)
        self._wake_leasers()
        return n

    async def stats(self) -> dict[str, int]:
        self._start()
        s = {**self._q.stats(), "calls_total": self._calls}
        self._wake_leasers()  # stats() may have re-queued expired leases
        return s

    async def clear_pending(self) -> int:
        self._start()
        return self._q.clear_pending()

    def _wake_leasers(self) -> None:
        # One wake-up per pending task is enough: each woken caller leases at least one.
        if self._q.num_pending:
            self._leasers.wake(self._q.num_pending)

    def _start(self) -> None:
        # Started on the first call: the actor's event loop is not running yet in __init__.
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._expire_forever())

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(self._expire_interval)
            self._q.expire()
            self._wake_leasers()


def _leases_out(got: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return _Unpacked([item for _, item in got], [lease_id for lease_id, _ in got])

