"""Agents used by the Gateway tests (importable by Ray workers: the test cluster puts the repo on PYTHONPATH)."""

from __future__ import annotations

import json
import time

from rayrl.agent import TaskContext

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


async def tool_agent(ctx: TaskContext, config: dict) -> dict:
    """`turns` model turns with a tool call + tool result between them, the history fed back as an OpenAI agent
    does. The random test model cannot be relied on to emit tool calls, so the assistant messages carry made-up
    tool_calls next to the content the Gateway returned. Records what each response said, for the test."""
    messages, seen = ctx.messages, []
    turns = config.get("turns", 3)
    for k in range(turns):
        max_tokens = config.get("max_tokens", 8)
        r = await ctx.llm.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=max_tokens,
                                                  temperature=0.0, logprobs=True)
        c = r.choices[0]
        seen.append({"content": c.message.content, "logprobs": [t.logprob for t in c.logprobs.content],
                     "completion_tokens": r.usage.completion_tokens, "finish_reason": c.finish_reason})
        if k == turns - 1:
            break
        args = json.dumps({"a": k, "b": 1})
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "add", "arguments": args}}
        messages = messages + [{"role": "assistant", "content": c.message.content, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": f"call_{k}", "content": str(k + 1)}]
    return {"reward": 1.0, "answer": seen[-1]["content"], "metadata": {"seen": seen}}


async def plain_agent(ctx: TaskContext, config: dict) -> dict:
    """One call with no sampling arguments: temperature and top_p come from the session (task.sampling)."""
    t0 = time.time()
    r = await ctx.llm.chat.completions.create(messages=ctx.messages, max_tokens=config.get("max_tokens", 16))
    t1 = time.time()
    events = [{"name": "llm", "start": t0, "end": t1},
              {"name": "tool:lookup", "start": t1, "end": time.time(), "cat": "tool"}]
    return {"reward": 0.0, "answer": r.choices[0].message.content, "metadata": {"events": events}}
