"""The sandbox role: SandboxActors started by `cluster.start` (sandbox.num_actors) run the tool agent's code for
episodes of any rollout worker, through `ctx.sandbox`."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rayrl.actors.sandbox import ActorSandbox
from rayrl.cluster import SandboxRemote
from tests.unit.test_tool_agent import FakeLLM, completion, make_ctx

pytestmark = pytest.mark.integration


def test_tool_agent_runs_code_in_a_shared_sandbox_actor(ray_cluster):
    from rayrl.agents.tool_agent import agent

    actor = SandboxRemote.options(name="rayrl/sandbox/test", num_cpus=0).remote({"timeout": 10})
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
