"""An agent that is a service of its own (the zeroclaw daemon of TACO's setup, or any HTTP agent): forward the
task, return the service's answer, let the RewardActor score it.

The service calls the Gateway at a base URL fixed in its own config (`<gateway>/v1`); the Gateway binds those
calls to this episode's session by the conversation prefix (the task text), so the trajectory is still recorded
token for token. `config` (rollout.agent_config):

    url / url_env          the service's base URL, or the env var holding it   (default env ZEROCLAW_GATEWAY_URL)
    token / token_env      bearer token, or the env var holding it             (default env ZEROCLAW_BEARER_TOKEN)
    path                   endpoint that takes a message                       (default /webhook)
    request_field          JSON field the task text goes in                    (default message)
    response_field         JSON field the answer comes back in                 (default response)
    timeout                seconds                                             (default 600)
"""

from __future__ import annotations

import os

import httpx

from rayrl.agent import TaskContext


async def agent(ctx: TaskContext, config: dict) -> dict:
    url = config.get("url") or os.environ.get(config.get("url_env", "ZEROCLAW_GATEWAY_URL"), "")
    if not url:
        raise ValueError("http_service agent: no service URL (agent_config.url, or the env var named by url_env)")
    token = config.get("token") or os.environ.get(config.get("token_env", "ZEROCLAW_BEARER_TOKEN"), "")
    task = next(m["content"] for m in reversed(ctx.messages) if m["role"] == "user")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=config.get("timeout", 600)) as http:
        r = await http.post(url.rstrip("/") + config.get("path", "/webhook"),
                            json={config.get("request_field", "message"): task}, headers=headers)
    r.raise_for_status()
    body = r.json()
    return {"reward": None, "answer": body.get(config.get("response_field", "response")), "metadata": {}}
