"""RolloutWorker: leases tasks, runs many agent episodes at once (asyncio), emits Trajectories.

Each episode: lease -> agent(ctx, config) with a session-bound chat client -> reward (the agent's, or
the RewardActor's) -> ack with the Trajectory. Anything that raises or times out becomes a failed
Trajectory carrying the exception text; the worker goes on.
"""

from __future__ import annotations

import asyncio
import time
import traceback

import ray

from rayrl.actors.engine import Sampling
from rayrl.agent import ChatClient, Session, TaskContext
from rayrl.config import Config, check_callable
from rayrl.types import Task, Trajectory


class RolloutWorker:
    """Plain class; `RolloutActor` below is the Ray actor."""

    def __init__(self, worker_id: str, cfg: Config, model_path: str, queue, engines: list, reward):
        from transformers import AutoTokenizer

        self.worker_id, self.cfg, self.queue, self.engines, self.reward = worker_id, cfg, queue, engines, reward
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.agent_fn = check_callable(cfg.rollout.agent, "rollout.agent")
        self.load = [0] * len(engines)  # this worker's requests in flight per engine (least-loaded routing)
        self.running = False
        self.done = 0
        self.failed = 0

    async def run(self) -> int:
        """Lease and run episodes until `stop()`; returns the number of episodes finished."""
        self.running = True
        slots = asyncio.Semaphore(self.cfg.rollout.concurrency)
        inflight: set[asyncio.Task] = set()
        while self.running:
            free = self.cfg.rollout.concurrency - len(inflight)
            if free == 0:
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            leases = await self.queue.lease.remote(self.worker_id, free, 1.0)  # blocks in the queue up to 1 s
            for lease_id, task in leases:
                t = asyncio.create_task(self._episode(slots, task))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight)
        return self.done

    def stop(self) -> None:
        self.running = False

    def stats(self) -> dict[str, int]:
        return {"done": self.done, "failed": self.failed}

    async def _episode(self, slots: asyncio.Semaphore, task: Task) -> None:
        async with slots:
            traj = await self.run_task(task)
        self.done += 1
        self.failed += traj.error is not None
        await self.queue.ack.remote(self.worker_id, [traj])

    async def run_task(self, task: Task) -> Trajectory:
        """One episode, never raising: failures come back as a Trajectory with `error` set."""
        t0 = time.perf_counter()
        session = Session()
        idx = min(range(len(self.engines)), key=lambda i: self.load[i])  # sticky: every turn goes to this engine
        engine = self.engines[idx]

        async def generate(prompt_ids: list[int], sampling: Sampling):
            self.load[idx] += 1
            try:
                return await engine.generate.remote(prompt_ids, sampling, f"{task.task_id}/{session.num_turns}")
            finally:
                self.load[idx] -= 1

        r = self.cfg.rollout
        llm = ChatClient(generate, self.tok, session, {"temperature": r.temperature, "top_p": r.top_p},
                         budget=r.max_response_length, max_prompt=self.cfg.data.max_prompt_length)
        ctx = TaskContext(task=task, llm=llm, run_config=self.cfg)
        try:
            out = await asyncio.wait_for(self.agent_fn(ctx, r.agent_config), r.agent_timeout)
            if not isinstance(out, dict):
                raise TypeError(f"the agent returned {type(out).__name__}, expected a dict with reward/answer/metadata")
        except asyncio.TimeoutError:
            return self._trajectory(task, session, error=f"agent timed out after {r.agent_timeout}s", t0=t0)
        except Exception as e:  # noqa: BLE001 - any agent failure is an outcome, not a crash
            return self._trajectory(task, session, error=_describe(e), t0=t0)
        t_agent = time.perf_counter()
        reward, error = out.get("reward"), None
        if session.num_turns == 0:
            error = "the agent made no LLM call: nothing to train on"
        elif reward is None:
            reward, error = await self._score(task, out.get("answer"))
        return self._trajectory(task, session, reward=reward, error=error, answer=out.get("answer"),
                                metadata=out.get("metadata") or {}, t0=t0,
                                timings={"agent": t_agent - t0, "reward": time.perf_counter() - t_agent})

    async def _score(self, task: Task, answer) -> tuple[float | None, str | None]:
        from rayrl.actors.reward import RewardRequest

        req = RewardRequest(task_id=task.task_id, data_source=task.data_source, solution_str=str(answer or ""),
                            ground_truth=task.ground_truth, extra_info=task.extra_info)
        try:
            [res] = await asyncio.wait_for(self.reward.score.remote([req]), self.cfg.reward.timeout + 30)
        except Exception as e:  # noqa: BLE001 - the reward actor died or hung: a failed trajectory
            return None, f"reward actor: {_describe(e)}"
        return res.score, res.error

    def _trajectory(self, task: Task, s: Session, t0: float, error: str | None = None, reward=None, answer=None,
                    metadata=None, timings=None) -> Trajectory:
        timings = dict(timings or {})
        timings["total"] = time.perf_counter() - t0
        return Trajectory(task_id=task.task_id, group_id=task.group_id, step=task.step, data_source=task.data_source,
                          prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                          logprobs=s.logprobs, reward=None if reward is None else float(reward), answer=answer,
                          metadata=metadata or {}, finish_reason=s.finish_reason, num_turns=s.num_turns,
                          policy_version=task.policy_version if s.policy_version is None else s.policy_version,
                          timings=timings, error=error, worker=self.worker_id)


def _describe(e: BaseException) -> str:
    if isinstance(e, ray.exceptions.RayTaskError):
        e = e.cause if e.cause is not None else e
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:500] if text else traceback.format_exception_only(e)[-1].strip()


RolloutActor = ray.remote(RolloutWorker)
