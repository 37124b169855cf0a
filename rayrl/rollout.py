"""Rollout: leases tasks, runs many agent episodes at once (asyncio), emits Trajectories.

Each episode: lease -> open a Gateway session -> agent(ctx, config) with `ctx.llm` an AsyncOpenAI client
bound to that session -> close the session (its record holds the exact token ids, logprobs and loss mask)
-> reward (the agent's, or the RewardActor's) -> ack with the Trajectory, in a batch with others (`Rollout.run`).
Anything that raises or times out becomes a failed Trajectory carrying the exception text; the worker goes on. Except
when the failure is another actor's (the Gateway, an engine, the RewardActor, a sandbox died or did not answer:
rayrl.recovery.InfraError): then the task goes back to the queue (`TaskQueue.retry`) to be run again, up to
`rollout.infra_retries` times. And except an over-long episode: an agent that raised because the Gateway refused its
next call for want of tokens (`sessions.ran_out`) gives a truncated trajectory, scored and trained as verl does
(`reward.overlong_buffer_len`: DAPO's penalty on top).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import traceback
import zlib

import httpx
import ray

from rayrl.agent import TaskContext, session_client
from rayrl.coalesce import Coalesced
from rayrl.config import Config, check_callable
from rayrl.queue import pack
from rayrl.recovery import InfraError, infra_role
from rayrl.sandbox import SandboxPool
from rayrl.sandbox.client import ActorSandbox
from rayrl.sessions import ran_out
from rayrl.types import SessionRecord, Task, Trajectory

log = logging.getLogger(__name__)


class Rollout:
    """One rollout worker; `rayrl.actors.rollout.RolloutActor` is its Ray actor."""

    def __init__(self, worker_id: str, cfg: Config, queue, gateway, reward, sandboxes=()):
        self.worker_id, self.cfg, self.queue, self.gateway, self.reward = worker_id, cfg, queue, gateway, reward
        # `ctx.sandbox`: the shared SandboxActors (episodes take turns), else a pool of this worker's own
        self.sandboxes = [ActorSandbox(h) for h in sandboxes] or [SandboxPool(cfg.sandbox)]
        self.episodes = 0
        self._outbox: list[Trajectory] = []  # finished trajectories not yet handed to the queue (`run`)
        self.agent_fn = check_callable(cfg.rollout.agent, "rollout.agent")
        # The Gateway's session calls of the episodes that start (end) in one turn of this worker's loop, as one call
        self._open = Coalesced(lambda reqs: asyncio.wait_for(self.gateway.open_sessions.remote(reqs), 60))
        self._close = Coalesced(lambda sids: asyncio.wait_for(self.gateway.close_sessions.remote(sids), 60))
        self._http, self._http_loop = None, None
        self._waits = WaitingSessions(None)  # the transport of self._http
        # Event-loop lag (`_watch_loop`): (perf_counter, seconds a LAG_TICK sleep overran), the last ~10 minutes
        self._lags: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(600 / LAG_TICK))

    async def run(self) -> None:
        """Lease and run episodes (`_dispatch`) for as long as the actor lives (the driver sees it end only when it
        dies), watching the event loop's lag meanwhile."""
        watch = asyncio.create_task(self._watch_loop())
        warm = asyncio.create_task(self._warm_sandboxes()) if self.cfg.sandbox.warm else None
        try:
            await self._dispatch()
        finally:
            watch.cancel()
            if warm is not None:
                warm.cancel()

    async def _warm_sandboxes(self) -> None:
        """sandbox.warm: this worker's own pools start their zygotes now, beside the first leases (a failure is the
        pool's to report at its first run, as without warming)."""
        for pool in self.sandboxes:
            if isinstance(pool, SandboxPool):
                try:
                    await pool.warm()
                except Exception as e:  # noqa: BLE001 - warming is an optimisation; the runs meet the same error
                    log.warning("rollout %s: warming the sandbox pool failed: %s: %s", self.worker_id,
                                type(e).__name__, e)

    async def _dispatch(self) -> None:
        """Lease episodes and run up to `rollout.concurrency` at once.

        Dispatch is batched: finished trajectories wait in an outbox and go to the queue with the next lease
        (`ack_and_lease`, for up to the free slots), one such call in flight at a time, so that a call carries what
        finished during the one before. A lease waits in the queue (up to 1 s) for tasks only when the last one found
        fewer than it asked for; trajectories that finish meanwhile go without it (`ack`, one call at a time)."""
        limit = self.cfg.rollout.concurrency
        episodes: set[asyncio.Task] = set()
        # Set when an episode or a queue call ends: one wake-up however many episodes run (no wait over all of them).
        poke = asyncio.Event()

        def ended(t: asyncio.Task) -> None:
            episodes.discard(t)
            poke.set()

        def start(coro) -> asyncio.Task:
            t = asyncio.create_task(coro)
            t.add_done_callback(ended)
            return t

        lease_call: asyncio.Task | None = None
        ack_call: asyncio.Task | None = None
        # short: the last lease found fewer tasks than it asked for, so the next waits in the queue for them (waits)
        asked, short, waits = 0, True, True
        while True:
            free = limit - len(episodes)
            if lease_call is None and free:
                lease_call = start(self._ack_and_lease(self._take_outbox(), free, 1.0 if short else 0.0))
                asked, waits = free, short
            elif lease_call is not None and waits and ack_call is None and self._outbox:
                ack_call = start(self._ack(self._take_outbox()))
            await poke.wait()
            poke.clear()  # no await since the wait: every end after this sets it again
            if ack_call is not None and ack_call.done():
                ack_call = None
            if lease_call is not None and lease_call.done():
                leases = lease_call.result()
                lease_call, short = None, len(leases) < asked
                episodes.update(start(self._episode(task)) for _, task in leases)

    async def _watch_loop(self) -> None:
        """How late this worker's event loop wakes up: every episode (agents, HTTP to the Gateway, the sandbox pool's
        pipes) shares it, so a busy loop shows as slower LLM and tool calls. Each trajectory gets the lag seen while
        it ran (`timings` loop_lag_mean / loop_lag_max; step metrics rollout/loop_lag_*)."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LAG_TICK)
            now = time.perf_counter()
            self._lags.append((now, max(now - t - LAG_TICK, 0.0)))

    def _lag_since(self, t0: float) -> dict[str, float]:
        lags = [lag for _, lag in itertools.takewhile(lambda e: e[0] >= t0, reversed(self._lags))]
        return {"loop_lag_mean": sum(lags) / len(lags), "loop_lag_max": max(lags)} if lags else {}

    def _take_outbox(self) -> list[Trajectory]:
        out, self._outbox = self._outbox, []
        return out

    async def _ack_and_lease(self, results: list[Trajectory], n: int, wait: float) -> list:
        """Ack `results`, lease up to `n` tasks (waiting up to `wait` s for them): the (lease id, task) pairs."""
        try:
            _, leases = await asyncio.wait_for(
                self.queue.ack_and_lease.remote(self.worker_id, pack(results), n, wait), wait + 60)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            # The queue died (Ray restarts it) or hung: the driver puts every uncollected task, these results' too,
            # in its successor; a lease given but not received expires back to the queue.
            await asyncio.sleep(1.0)
            return []
        return leases

    async def _ack(self, results: list[Trajectory]) -> None:
        try:
            await asyncio.wait_for(self.queue.ack.remote(self.worker_id, pack(results)), 60)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            pass  # as in _ack_and_lease

    async def _episode(self, task: Task) -> None:
        try:
            traj = await self.run_task(task)
        except InfraError as e:
            traj = await self._retry(task, e)
        if traj is not None:
            self._outbox.append(traj)

    async def _retry(self, task: Task, e: InfraError) -> Trajectory | None:
        """Hand the task back to the queue (None), or, past rollout.infra_retries, the failed trajectory that says
        which role failed."""
        r = self.cfg.rollout
        try:
            refused = await self.queue.retry.remote(self.worker_id, [task.task_id], r.infra_retries,
                                                    r.infra_retry_delay)
        except ray.exceptions.RayActorError:
            return None  # the queue died too: the driver puts the task in its successor
        if not refused:
            return None
        return self._trajectory(task, SessionRecord("", task.task_id), t0=time.perf_counter(),
                                error=f"{e} (infrastructure failure; still failing after "
                                      f"rollout.infra_retries={r.infra_retries} retries)")

    async def run_task(self, task: Task) -> Trajectory:
        """One episode. Its own failures (the agent's, the reward's) come back as a Trajectory with `error` set; it
        raises InfraError when an actor it needs died or did not answer (the task is then run again)."""
        t0, w0 = time.perf_counter(), time.time()
        r = self.cfg.rollout
        last_user = next((m.get("content") for m in reversed(task.messages) if m.get("role") == "user"), None)
        try:
            sid, key, base_url = await asyncio.wait_for(self._open(dict(
                task_id=task.task_id, budget=r.max_response_length, max_prompt=self.cfg.data.max_prompt_length,
                match=last_user if isinstance(last_user, str) and last_user else None, **task.sampling)), 60)
        except Exception as e:  # the gateway died, hung or is not listening yet
            raise InfraError("gateway", _describe(e)) from e
        # the Gateway's session calls as trace spans: the episode's span starts with the first (rayrl.trace)
        spans = [{"name": "gateway:open", "start": w0, "end": time.time()}]
        gw = self.cfg.gateway
        llm = session_client(base_url, key, gw.model_name, gw.request_timeout, self._client())
        self.episodes += 1
        sandbox = self.sandboxes[self.episodes % len(self.sandboxes)]
        ctx = TaskContext(task=task, llm=llm, run_config=self.cfg, session_id=sid, base_url=base_url, api_key=key,
                          sandbox=sandbox)
        out, error, infra = None, None, None
        try:
            out = await asyncio.wait_for(self.agent_fn(ctx, r.agent_config), r.agent_timeout)
            if not isinstance(out, dict):
                raise TypeError(f"the agent returned {type(out).__name__}, expected a dict with reward/answer/metadata")
        except asyncio.TimeoutError:
            error = f"agent timed out after {r.agent_timeout}s"
            if self._waits.cut.pop(sid, False):  # it was waiting for the LLM's answer: the engine did not give one
                infra = InfraError("engine", f"an LLM call unanswered after rollout.agent_timeout={r.agent_timeout}s")
        except Exception as e:  # noqa: BLE001 - any agent failure is an outcome, not a crash
            error = _describe(e)
            role = infra_role(e)
            infra = None if role is None else InfraError(role, error)
        self._waits.cut.pop(sid, None)
        w1 = time.time()
        try:
            rec: SessionRecord = await asyncio.wait_for(self._close(sid), 60)
        except Exception as e:  # the gateway died or hung (its sessions are gone with it)
            raise InfraError("gateway", _describe(e)) from e
        spans.append({"name": "gateway:close", "start": w1, "end": time.time()})
        if infra is not None:
            raise infra
        if rec.policy_version is not None and rec.policy_version < task.policy_version:
            # an engine restarted (rayrl.recovery) served this before it got the current weights
            raise InfraError("engine", f"served at policy version {rec.policy_version} < the task's "
                                       f"{task.policy_version}: a restarted engine without the current weights")
        if error is not None:
            if not ran_out(rec):
                return self._trajectory(task, rec, error=error, t0=t0, spans=spans)
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
                                metadata=metadata, t0=t0, spans=spans,
                                timings={"agent": t_agent - t0, "reward": time.perf_counter() - t_agent})

    def _client(self):
        """One HTTP client per worker (per event loop), shared by its episodes' clients, over a few connection
        pools (`ShardedTransport`)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            g = self.cfg.gateway
            self._waits = WaitingSessions(ShardedTransport(self.cfg.rollout.concurrency) if g.enabled
                                          else RayTransport(self.gateway))
            self._http = httpx.AsyncClient(transport=self._waits, timeout=g.request_timeout)
            self._http_loop = loop
        return self._http

    async def _score(self, req) -> tuple[float | None, str | None]:
        try:
            [res] = await asyncio.wait_for(self.reward.score.remote([req]), self.cfg.reward.timeout + 30)
        except Exception as e:  # the reward actor died or hung (a hung scorer is its own result)
            raise InfraError("reward", _describe(e)) from e
        return res.score, res.error

    def _trajectory(self, task: Task, s: SessionRecord, t0: float, error: str | None = None, reward=None, answer=None,
                    metadata=None, timings=None, spans=()) -> Trajectory:
        timings = {**(timings or {}), **self._lag_since(t0)}
        timings["total"] = time.perf_counter() - t0
        # one trace span per engine call (rayrl.trace), from the Gateway's record
        events = [{"name": "llm", "start": t.start, "end": t.end,
                   "args": {"completion_tokens": len(t.token_ids), "env_tokens": t.env_len, "tool_calls": t.tool_calls}}
                  for t in s.turns]
        # the agent's own spans (tool calls, sandbox runs) and the reward's; the Gateway's record has the LLM calls
        events += [e for e in (metadata or {}).pop("events", []) if isinstance(e, dict) and e.get("name") != "llm"
                   and isinstance(e.get("start"), float) and isinstance(e.get("end"), float)]
        events += spans
        return Trajectory(task_id=task.task_id, group_id=task.group_id, step=task.step, data_source=task.data_source,
                          prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                          logprobs=s.logprobs, versions=s.versions, reward=None if reward is None else float(reward),
                          answer=answer, metadata=metadata or {}, finish_reason=s.finish_reason, num_turns=s.num_turns,
                          policy_version=task.policy_version if s.policy_version is None else s.policy_version,
                          timings=timings, error=error, worker=self.worker_id, events=events)


LAG_TICK = 0.05  # seconds between the event-loop lag probes of a rollout worker


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


class WaitingSessions(httpx.AsyncBaseTransport):
    """The worker's transport to the Gateway (`inner`), noting the sessions whose request was cancelled while it
    waited for the answer (`cut`): an agent timed out there was waiting on an engine, not hung itself."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None):
        self.inner = inner
        self.cut: dict[str, bool] = {}  # session id -> True; run_task takes its own out

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except asyncio.CancelledError:
            parts = request.url.path.split("/")  # /sessions/<sid>/v1/...
            if len(parts) > 2 and parts[1] == "sessions":
                self.cut[parts[2]] = True
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


class ShardedTransport(httpx.AsyncBaseTransport):
    """HTTP to the Gateway over one connection pool per SESSIONS_PER_POOL episodes in flight, a session's calls
    always through the same pool. httpcore looks at every connection of a pool each time a request starts or ends,
    so one pool for all of a worker's episodes costs it CPU per LLM call that grows with the episodes in flight
    (bench/gateway_http.py, BENCHMARKS.md)."""

    def __init__(self, concurrency: int, sessions_per_pool: int | None = None):
        per = sessions_per_pool or SESSIONS_PER_POOL
        n = max(1, -(-concurrency // per))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=2 * per)
        self.pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(n)]
        self._next = itertools.count()

    def pool(self, request: httpx.Request) -> httpx.AsyncHTTPTransport:
        parts = request.url.path.split("/")  # /sessions/<sid>/v1/...: by session; anything else in turn
        key = zlib.crc32(parts[2].encode()) if len(parts) > 2 and parts[1] == "sessions" else next(self._next)
        return self.pools[key % len(self.pools)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.pool(request).handle_async_request(request)

    async def aclose(self) -> None:
        for p in self.pools:
            await p.aclose()


SESSIONS_PER_POOL = 8  # episodes whose LLM calls share one connection pool (ShardedTransport)


class RayTransport(httpx.AsyncBaseTransport):
    """httpx transport to the Gateway actor through Ray calls instead of TCP (gateway.enabled=false)."""

    def __init__(self, gateway):
        self.gateway = gateway

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        try:
            status, headers, content = await self.gateway.request.remote(
                request.method, request.url.raw_path.decode(), dict(request.headers), body)
        except ray.exceptions.RayActorError as e:
            raise InfraError("gateway", _describe(e)) from e
        return httpx.Response(status, headers=headers, content=content, request=request)

    async def aclose(self) -> None:
        pass

