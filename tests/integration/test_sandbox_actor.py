"""The sandbox role: SandboxActors started by `cluster.start` (sandbox.num_actors) run the tool agent's code for
episodes of any rollout worker, through `ctx.sandbox`."""

from __future__ import annotations

import asyncio
import os

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
        llm = FakeLLM([completion("Let me compute.", [("code_interpreter", {"code": "import os; print(2 ** 5 + 2, os.getppid())"})]),
                       completion("The result is \\boxed{34}.")])
        out = asyncio.run(agent(make_ctx(llm, ActorSandbox(actor)), {}))
        tool = llm.requests[1]["messages"][-1]
        assert tool["role"] == "tool" and tool["content"].startswith("34 ")
        # the code ran under the actor's process tree, not the caller's
        assert int(tool["content"].split()[1]) != os.getpid()
        stats = ray.get(actor.stats.remote(), timeout=30)
        assert stats["runs"] == 1 and stats["errors"] == 0
        assert out["metadata"]["tool_calls"] == 1 and out["metadata"]["sandbox_errors"] == 0
    finally:
        ray.get(actor.close.remote(), timeout=30)
        ray.kill(actor)
