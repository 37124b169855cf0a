"""The default agent: one chat completion, scored by the RewardActor (reward=None)."""

from __future__ import annotations

from rayrl.agent import TaskContext


async def agent(ctx: TaskContext, config: dict) -> dict:
    reply = await ctx.llm.chat.completions.create(messages=ctx.messages, **config.get("sampling", {}))
    choice = reply.choices[0]
    return {"reward": None, "answer": choice.message.content, "metadata": {"finish_reason": choice.finish_reason}}
