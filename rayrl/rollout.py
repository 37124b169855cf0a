"""Rollout: leases tasks, runs many agent episodes at once (asyncio), emits Trajectories.

Each episode: lease -> open a Gateway session -> agent(ctx, config) with `ctx.llm` an AsyncOpenAI client
bound to that session -> close the session (its record holds the exact token ids, logprobs and loss mask)
-> reward (the agent's, or the RewardActor's) -> ack with the Trajectory. Anything that raises or times
out becomes a failed Trajectory carrying the exception text; the worker goes on. Except an over-long episode:
an agent that raised because the Gateway refused its next call for want of tokens (`sessions.ran_out`) gives a
truncated trajectory, scored and trained as verl does (`reward.overlong_buffer_len`: DAPO's penalty on top).
"""

from __future__ import annotations

import asyncio
import time
import traceback

import httpx
import ray

from rayrl.agent import TaskContext, session_client
from rayrl.config import Config, check_callable
from rayrl.sandbox import SandboxPool
from rayrl.sandbox.client import ActorSandbox
from rayrl.sessions import ran_out
from rayrl.types import SessionRecord, Task, Trajectory


class Rollout:
    """One rollout worker; `RolloutActor` below is its Ray actor."""

    def __init__(self, worker_id: str, cfg: Config, queue, gateway, reward, sandboxes=()):
        self.worker_id, self.cfg, self.queue, self.gateway, self.reward = worker_id, cfg, queue, gateway, reward
        # `ctx.sandbox`: the shared SandboxActors (episodes take turns), else a pool of this worker's own
        self.sandboxes = [ActorSandbox(h) for h in sandboxes] or [SandboxPool(cfg.sandbox)]
        self.episodes = 0
        self.agent_fn = check_callable(cfg.rollout.agent, "rollout.agent")
        self._http, self._http_loop = None, None

    async def run(self) -> None:
        """Lease and run episodes for as long as the actor lives (the driver sees it end only when it dies)."""
        slots = asyncio.Semaphore(self.cfg.rollout.concurrency)
        inflight: set[asyncio.Task] = set()
        while True:
            free = self.cfg.rollout.concurrency - len(inflight)
            if free == 0:
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            leases = await self.queue.lease.remote(self.worker_id, free, 1.0)  # blocks in the queue up to 1 s
            for _, task in leases:
                t = asyncio.create_task(self._episode(slots, task))
                inflight.add(t)
                t.add_done_callback(inflight.discard)

    async def _episode(self, slots: asyncio.Semaphore, task: Task) -> None:
        async with slots:
            traj = await self.run_task(task)
        await self.queue.ack.remote(self.worker_id, [traj])

    async def run_task(self, task: Task) -> Trajectory:
        """One episode, never raising: failures come back as a Trajectory with `error` set."""
        t0 = time.perf_counter()
        r = self.cfg.rollout
        last_user = next((m.get("content") for m in reversed(task.messages) if m.get("role") == "user"), None)
        try:
            sid, key, base_url = await asyncio.wait_for(self.gateway.open_session.remote(
                task.task_id, budget=r.max_response_length, max_prompt=self.cfg.data.max_prompt_length,
                match=last_user if isinstance(last_user, str) and last_user else None, **task.sampling), 60)
        except Exception as e:  # noqa: BLE001 - the gateway died or hung: a failed trajectory, the lease is acked
            return self._trajectory(task, SessionRecord("", task.task_id), t0=t0, error=f"gateway: {_describe(e)}")
        gw = self.cfg.gateway
        llm = session_client(base_url, key, gw.model_name, gw.request_timeout, self._client())
        self.episodes += 1
        sandbox = self.sandboxes[self.episodes % len(self.sandboxes)]
        ctx = TaskContext(task=task, llm=llm, run_config=self.cfg, session_id=sid, base_url=base_url, api_key=key,
                          sandbox=sandbox)
        out, error = None, None
        try:
            out = await asyncio.wait_for(self.agent_fn(ctx, r.agent_config), r.agent_timeout)
            if not isinstance(out, dict):
                raise TypeError(f"the agent returned {type(out).__name__}, expected a dict with reward/answer/metadata")
        except asyncio.TimeoutError:
            error = f"agent timed out after {r.agent_timeout}s"
        except Exception as e:  # noqa: BLE001 - any agent failure is an outcome, not a crash
            error = _describe(e)
        try:
            rec: SessionRecord = await asyncio.wait_for(self.gateway.close_session.remote(sid), 60)
        except Exception as e:  # noqa: BLE001
            return self._trajectory(task, SessionRecord(sid, task.task_id), t0=t0, error=f"gateway: {_describe(e)}")
        if error is not None:
            if not ran_out(rec):
                return self._trajectory(task, rec, error=error, t0=t0)
            # Over-long: the budget ran out mid-episode and the refused call raised in the agent. verl trains such a
            # response truncated at max_response_length and scores it: here, as an episode that gave no answer.
            out = {"answer": "", "metadata": {"truncated": error}}
        t_agent = time.perf_counter()
        reward, error = out.get("reward"), None
        metadata = dict(out.get("metadata") or {})
        if rec.num_turns == 0:
            error = "the agent made no LLM call: nothing to train on"
        elif reward is None:
            w0 = time.time()
            # verl's turn count (tool/user turns + replies + 1); an agent that does not report it alternated: 2 per call
            num_turns = metadata.get("num_turns", 2 * rec.num_turns)
            reward, error = await self._score(reward_request(task, out.get("answer"), num_turns))
            metadata.setdefault("events", []).append({"name": "reward", "start": w0, "end": time.time()})
        rw = self.cfg.reward
        if reward is not None and error is None and rw.overlong_buffer_len:
            penalty = overlong_penalty(len(rec.response_ids), r.max_response_length, rw.overlong_buffer_len,
                                       rw.overlong_penalty_factor)
            if penalty:
                metadata["overlong_penalty"] = penalty  # validation's acc is taken before it
                reward = float(reward) + penalty
        if rec.parse_errors:
            metadata.setdefault("tool_parse_errors", rec.parse_errors)
        return self._trajectory(task, rec, reward=reward, error=error, answer=out.get("answer"),
                                metadata=metadata, t0=t0,
                                timings={"agent": t_agent - t0, "reward": time.perf_counter() - t_agent})

    def _client(self):
        """One HTTP connection pool per worker (per event loop), shared by its episodes' clients."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            g = self.cfg.gateway
            transport = None if g.enabled else RayTransport(self.gateway)
            self._http = httpx.AsyncClient(transport=transport, timeout=g.request_timeout,
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=
                                                               2 * self.cfg.rollout.concurrency))
            self._http_loop = loop
        return self._http

    async def _score(self, req) -> tuple[float | None, str | None]:
        try:
            [res] = await asyncio.wait_for(self.reward.score.remote([req]), self.cfg.reward.timeout + 30)
        except Exception as e:  # noqa: BLE001 - the reward actor died or hung: a failed trajectory
            return None, f"reward actor: {_describe(e)}"
        return res.score, res.error

    def _trajectory(self, task: Task, s: SessionRecord, t0: float, error: str | None = None, reward=None, answer=None,
                    metadata=None, timings=None) -> Trajectory:
        timings = dict(timings or {})
        timings["total"] = time.perf_counter() - t0
        # one trace span per engine call (rayrl.trace), from the Gateway's record
        events = [{"name": "llm", "start": t.start, "end": t.end,
                   "args": {"completion_tokens": len(t.token_ids), "env_tokens": t.env_len, "tool_calls": t.tool_calls}}
                  for t in s.turns]
        # the agent's own spans (tool calls, sandbox runs) and the reward's; the Gateway's record has the LLM calls
        events += [e for e in (metadata or {}).pop("events", []) if isinstance(e, dict) and e.get("name") != "llm"
                   and isinstance(e.get("start"), float) and isinstance(e.get("end"), float)]
        return Trajectory(task_id=task.task_id, group_id=task.group_id, step=task.step, data_source=task.data_source,
                          prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                          logprobs=s.logprobs, reward=None if reward is None else float(reward), answer=answer,
                          metadata=metadata or {}, finish_reason=s.finish_reason, num_turns=s.num_turns,
                          policy_version=task.policy_version if s.policy_version is None else s.policy_version,
                          timings=timings, error=error, worker=self.worker_id, events=events)


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float) -> float:
    """DAPO's overlong penalty (verl's DAPORewardManager with reward_model.overlong_buffer): 0 up to
    max_length - buffer_len response tokens (tool results included, as verl counts them), then linearly down to
    -factor at max_length."""
    return min(-(length - (max_length - buffer_len)) / buffer_len * factor, 0.0)


def reward_request(task: Task, answer, num_turns: int):
    """What the RewardActor scores for an episode: its answer, with the task's extra_info plus the episode's turn
    count under "num_turns", as verl's reward managers pass it (ReTool's scorer shapes wrong answers by it)."""
    from rayrl.scoring import RewardRequest

    return RewardRequest(task_id=task.task_id, data_source=task.data_source, solution_str=str(answer or ""),
                         ground_truth=task.ground_truth, extra_info={**task.extra_info, "num_turns": num_turns})


def _describe(e: BaseException) -> str:
    if isinstance(e, ray.exceptions.RayTaskError):
        e = e.cause if e.cause is not None else e
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:500] if text else traceback.format_exception_only(e)[-1].strip()


class RayTransport(httpx.AsyncBaseTransport):
    """httpx transport to the Gateway actor through Ray calls instead of TCP (gateway.enabled=false)."""

    def __init__(self, gateway):
        self.gateway = gateway

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        status, headers, content = await self.gateway.request.remote(request.method, request.url.raw_path.decode(),
                                                                       dict(request.headers), body)
        return httpx.Response(status, headers=headers, content=content, request=request)

    async def aclose(self) -> None:
        pass

