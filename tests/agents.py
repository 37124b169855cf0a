"""Agents used by the integration tests (importable by Ray workers: the test cluster puts the repo on PYTHONPATH)."""

from __future__ import annotations

import asyncio

from rayrl.agent import TaskContext


async def slow_agent(ctx: TaskContext, config: dict) -> dict:
    """Sleeps first, so a test can kill the worker while it holds leases."""
    await asyncio.sleep(config.get("sleep", 3.0))
    reply = await ctx.llm.chat.completions.create(messages=ctx.messages, max_tokens=4)
    return {"reward": float(len(reply.choices[0].message.content) % 2), "answer": None, "metadata": {}}


async def flaky_agent(ctx: TaskContext, config: dict) -> dict:
    """Raises on every third sample, after one LLM call: a failed trajectory, and the run goes on."""
    reply = await ctx.llm.chat.completions.create(messages=ctx.messages)
    if ctx.task.task_id.endswith("/2"):
        raise RuntimeError("tool crashed")
    return {"reward": None, "answer": reply.choices[0].message.content, "metadata": {}}
