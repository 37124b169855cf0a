"""RewardActor: scores answers in a process pool, each score under a timeout.

A scorer may hang (sympy on a pathological expression) or crash its interpreter; neither may stall
rollouts or turn into a reward. Each score runs in a `pebble.ProcessPool` worker; a score that
runs past `timeout` has its worker process killed (pebble restarts it), and the result says so.
`Reward` is the plain class (tested without Ray); `RewardActor` is its Ray actor.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from rayrl import rewards

# Extra seconds allowed for a killed worker to be respawned (and re-import its scorer) before the
# backstop below gives up on a result; the pool itself enforces `timeout` from the moment a score starts.
_RESTART_SLACK = 60.0
_MAX_ERROR_CHARS = 1000


@dataclass
class RewardRequest:
    """One answer to score."""

    task_id: str
    data_source: str
    solution_str: str  # the answer text the agent produced
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)  # the task's, plus the episode's "num_turns" (as verl)


@dataclass
class RewardResult:
    """One score, or the reason there is none (score is then None, never a stand-in 0.0)."""

    task_id: str
    score: float | None
    error: str | None = None
    seconds: float = 0.0  # from submission to result, queueing included

    @property
    def ok(self) -> bool:
        return self.error is None and self.score is not None


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]


def _pool_timeout(fut: Any) -> bool:
    """True when pebble ended this score for running past its timeout."""
    if fut is None or not fut.done() or fut.cancelled():
        return False
    e = fut.exception()
    return isinstance(e, TimeoutError) and e.args[:1] == ("Task timeout",)


class Reward:
    """Scores RewardRequests with `reward.fn` = `spec`, `num_procs` processes, `timeout` s per score."""

    def __init__(self, spec: str, timeout: float, num_procs: int) -> None:
        if timeout <= 0:
            raise ValueError(f"reward.timeout must be > 0, got {timeout}")
        if num_procs < 1:
            raise ValueError(f"reward.num_procs must be >= 1, got {num_procs}")
        rewards.resolve_scorer(spec)  # a bad spec fails here with a ConfigError, not on every score
        self.spec = spec
        self.timeout = float(timeout)
        self.num_procs = num_procs
        self._inflight = 0
        self._closed = False
        self.counts = {"scored": 0, "errors": 0, "timeouts": 0}
        self._pool = self._new_pool()

    def _new_pool(self) -> Any:
        import pebble

        # spawn, not fork: the parent is a Ray worker with gRPC threads, which fork would copy mid-flight.
        pool = pebble.ProcessPool(max_workers=self.num_procs, initializer=rewards.warm, initargs=(self.spec,),
                                  context=multiprocessing.get_context("spawn"))
        # Start the workers now rather than on the first score. The task is a function of rayrl.rewards,
        # not of this module, so pool workers never import ray.
        for _ in range(self.num_procs):
            pool.schedule(rewards.warm, args=(self.spec,))
        return pool

    def _submit(self, req: RewardRequest) -> Any:
        args = (self.spec, req.data_source, req.solution_str, req.ground_truth, req.extra_info)
        try:
            return self._pool.schedule(rewards.score_with_spec, args=args, timeout=self.timeout)
        except RuntimeError:
            if self._closed:
                raise
            # The pool stopped under us (a pebble manager thread died): start a fresh one once.
            self._pool = self._new_pool()
            return self._pool.schedule(rewards.score_with_spec, args=args, timeout=self.timeout)

    async def _score_one(self, req: RewardRequest) -> RewardResult:
        start = time.monotonic()
        # Backstop for a wedged pool only: room for everything queued ahead of this score to time out.
        ahead = self._inflight // self.num_procs + 1
        backstop = (self.timeout + _RESTART_SLACK) * ahead + _RESTART_SLACK
        self._inflight += 1
        fut = None
        try:
            fut = self._submit(req)
            score = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=backstop)
            result = RewardResult(req.task_id, float(score), None, time.monotonic() - start)
        except TimeoutError as e:
            if _pool_timeout(fut):
                error = f"reward timed out after {self.timeout:g}s"  # pebble killed the worker
                self.counts["timeouts"] += 1
            elif fut is not None and fut.done():
                error = _describe(e)  # the scorer itself raised TimeoutError
            else:
                if fut is not None:
                    fut.cancel()  # kills the worker if the score is running
                error = f"reward pool gave no answer within {backstop:g}s"
                self.counts["timeouts"] += 1
            result = RewardResult(req.task_id, None, error, time.monotonic() - start)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller was cancelled: not a scoring outcome
            # The pool cancelled the score (closed while it was queued or running): still an answer.
            result = RewardResult(req.task_id, None, "reward cancelled: the pool was stopped", time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - every failure becomes a recorded outcome
            result = RewardResult(req.task_id, None, _describe(e), time.monotonic() - start)
        finally:
            self._inflight -= 1
        if result.ok:
            self.counts["scored"] += 1
        else:
            self.counts["errors"] += 1
        return result

    async def score(self, items: list[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order; failures and timeouts are results with `error` set."""
        if self._closed:
            raise RuntimeError("Reward is closed")
        return list(await asyncio.gather(*(self._score_one(r) for r in items)))

    def stats(self) -> dict[str, int]:
        """Counts since start: scored, errors (timeouts included), timeouts, in flight."""
        return {**self.counts, "inflight": self._inflight}

    def close(self) -> None:
        """Stop the pool and its processes (running scores are killed)."""
        if self._closed:
            return
        self._closed = True
        self._pool.stop()
        self._pool.join(timeout=10)


# An async actor: many rollout workers' score calls interleave; the pool bounds the real parallelism.
RewardActor = ray.remote(max_concurrency=256)(Reward)
