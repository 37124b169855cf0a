"""The rayrl side of an external agent: forward the task to the service and return its answer.

The service calls the Gateway itself (fixed base URL and key); the Gateway records those calls in this
episode's session by matching the conversation against the task text. Job config:

    rollout:
      agent: examples.external_agent.agent:agent
      agent_config: {service_url: http://127.0.0.1:9100}
"""

from __future__ import annotations

import os

import httpx

from rayrl.agent import TaskContext


async def agent(ctx: TaskContext, config: dict) -> dict:
    url = config.get("service_url") or os.environ["AGENT_SERVICE_URL"]
    task = next(m["content"] for m in reversed(ctx.messages) if m["role"] == "user")
    async with httpx.AsyncClient(timeout=config.get("timeout", 600)) as http:
        r = await http.post(f"{url.rstrip('/')}/run", json={"task": task, "task_id": ctx.task.task_id})
    r.raise_for_status()
    out = r.json()
    return {"reward": None, "answer": out["answer"], "metadata": {"service_turns": out.get("turns")}}
