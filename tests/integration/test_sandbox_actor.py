"""The sandbox role: SandboxActors started by `cluster.start` (sandbox.num_actors) run the tool agent's code for
episodes of any rollout worker, through `ctx.sandbox`; without them each worker runs a pool of its own."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rayrl.actors.sandbox import SandboxActor
from rayrl.config import SandboxConfig, load_config
from rayrl.rollout import Rollout
from rayrl.sandbox import SandboxPool
from rayrl.sandbox.client import ActorSandbox
from tests.helpers import FakeLLM, completion, make_ctx

pytestmark = pytest.mark.integration


def test_tool_agent_runs_code_in_a_shared_sandbox_actor(ray_cluster):
    from rayrl.agents.tool_agent import agent

    actor = SandboxActor.options(name="rayrl/sandbox/test", num_cpus=0).remote(SandboxConfig(timeout=10))
    try:
        llm = FakeLLM([completion("Let me compute.", [("code_interpreter", {"code": "print(2 ** 5 + 2)"})]),
                       completion("The result is \\boxed{34}.")])
        out = asyncio.run(agent(make_ctx(llm, ActorSandbox(actor)), {}))
        assert llm.requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": "34"}
        stats = ray.get(actor.stats.remote(), timeout=30)  # the run went through the actor's pool
        assert stats["runs"] == 1 and stats["errors"] == 0
        assert out["metadata"]["tool_calls"] == 1 and out["metadata"]["sandbox_errors"] == 0
    finally:
        ray.get(actor.close.remote(), timeout=30)
        ray.kill(actor)


def test_warm_starts_the_shared_actors_zygotes(ray_cluster) -> None:
    """sandbox.warm with shared SandboxActors: cluster.start calls warm() on each; every slot's zygote is then up
    before the first run."""
    actor = SandboxActor.options(num_cpus=0).remote(SandboxConfig(max_concurrency=2, warm=True))
    try:
        ray.get(actor.warm.remote(), timeout=60)
        live = ray.get(actor.__ray_call__.remote(
            lambda self: sorted(s for s, z in self.pool._backend._zygotes.items() if z.alive())), timeout=30)
        assert live == [0, 1], live
    finally:
        ray.get(actor.close.remote(), timeout=30)
        ray.kill(actor)


def test_a_full_actor_answers_with_an_error_result(ray_cluster) -> None:
    actor = SandboxActor.options(num_cpus=0).remote(SandboxConfig(max_concurrency=1, max_queue=0))
    try:
        ray.get(actor.stats.remote(), timeout=60)  # started: calls below arrive in order
        sandbox = ActorSandbox(actor)

        async def go():
            first = asyncio.ensure_future(sandbox.run("import time\ntime.sleep(1.0)\nprint('a')"))
            await asyncio.sleep(0.3)  # the first now holds the only slot
            second = await sandbox.run("print('b')")
            return await first, second
        a, b = asyncio.run(go())
        assert a.stdout == "a\n", a
        # max_queue=0 and one slot busy: the second is refused at once, as a result (not a raised error)
        assert b.error and "queue full" in b.error
        stats = ray.get(actor.stats.remote(), timeout=30)
        assert stats["runs"] == 1 and stats["rejected"] == 1
        ray.get(actor.close.remote(), timeout=30)
    finally:
        ray.kill(actor)


def test_ctx_sandbox_is_the_shared_actors_else_a_pool_of_the_worker(ray_cluster) -> None:
    cfg = load_config(None, ["rollout.agent=rayrl.agents.tool_agent:agent", "sandbox.max_concurrency=1"],
                      check_files=False)
    [own] = Rollout("test/0", cfg, None, None, None).sandboxes
    assert isinstance(own, SandboxPool) and own.config is cfg.sandbox
    handles = [SandboxActor.options(num_cpus=0).remote(cfg.sandbox) for _ in range(2)]
    try:
        shared = Rollout("test/1", cfg, None, None, None, handles).sandboxes
        assert [s.handle for s in shared] == handles and all(isinstance(s, ActorSandbox) for s in shared)
    finally:
        for h in handles:
            ray.kill(h)
