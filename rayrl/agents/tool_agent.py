"""ReTool-style agent: the model writes code, a sandbox runs it, the output goes back, up to `max_turns` turns.

    rollout:
      agent: rayrl.agents.tool_agent:agent
      agent_config:
        max_turns: 8
        max_tool_response_length: 4096       # characters per tool result fed back (middle cut)
        tools:                               # default: the built-in code_interpreter alone
          - builtin: code_interpreter        # runs on ctx.sandbox (the job's `sandbox` section: backend, limits)
          - schema: {type: function, function: {name: lookup, description: ..., parameters: {...}}}
            handler: my_pkg.tools:lookup     # async def lookup(ctx, args: dict) -> str

Each turn is one `ctx.llm.chat.completions.create(messages=..., tools=...)` (hermes tool calls). Tool calls come
from `message.tool_calls`, or, when the server left them in the text, from `<tool_call>{json}</tool_call>` in
`message.content`. Results go back as `{"role": "tool", "tool_call_id": ..., "content": ...}`. The episode ends
at a reply without tool calls (the final answer, in \\boxed{}), a reply cut by length, or after max_turns.
reward is None: the RewardActor scores the answer (`reward.fn: math_dapo` in the ReTool jobs).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rayrl.chat import parse_tool_calls
from rayrl.sandbox import SandboxFull

CODE_INTERPRETER = {  # seed 001's tool_schema
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "A tool for executing code.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to execute."}},
            "required": ["code"],
        },
    },
}

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves math problems step by step. You can run Python code with the "
    "code_interpreter tool to compute, check or explore; the tool returns what the code prints (use print). "
    "Each call starts a fresh interpreter: define everything you use in the same call. When you are done, "
    "give the final answer in \\boxed{}."
)

ToolHandler = Callable[[Any, dict], Awaitable[Any]]


@dataclass
class _Tool:
    schema: dict
    handler: ToolHandler | None  # None: the built-in code_interpreter

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def load_tools(specs: list[dict] | None) -> dict[str, _Tool]:
    """agent_config["tools"] -> {name: tool}. Raises ValueError naming the bad entry."""
    from rayrl.config import check_callable

    tools: dict[str, _Tool] = {}
    for i, spec in enumerate(specs if specs is not None else [{"builtin": "code_interpreter"}]):
        where = f"agent_config.tools[{i}]"
        if not isinstance(spec, dict):
            raise ValueError(f"{where} must be a mapping, got {spec!r}")
        if spec.get("builtin") is not None:
            if spec["builtin"] != "code_interpreter":
                raise ValueError(f"{where}.builtin={spec['builtin']!r}: the only built-in tool is code_interpreter")
            tool = _Tool(spec.get("schema") or CODE_INTERPRETER, None)
        else:
            schema, handler = spec.get("schema"), spec.get("handler")
            if not (isinstance(schema, dict) and isinstance(schema.get("function"), dict)
                    and isinstance(schema["function"].get("name"), str)):
                raise ValueError(f"{where}.schema must be an OpenAI function schema "
                                 "({type: function, function: {name, description, parameters}})")
            if not isinstance(handler, str):
                raise ValueError(f"{where}.handler must be 'module:function' (async def fn(ctx, args) -> str)")
            tool = _Tool(schema, check_callable(handler, f"{where}.handler"))
        if tool.name in tools:
            raise ValueError(f"{where}: a tool named {tool.name!r} is declared twice")
        tools[tool.name] = tool
    return tools


def _sandbox(ctx: Any) -> Any:
    if ctx.sandbox is None:
        raise RuntimeError("the code_interpreter tool needs ctx.sandbox (the rollout worker sets it: a SandboxPool "
                           "or SandboxActor from the `sandbox` config section)")
    return ctx.sandbox


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """At most `limit` characters (plus a marker): keep the head, the tail, or both ends (middle)."""
    if limit <= 0 or len(text) <= limit:
        return text
    cut = len(text) - limit
    if side == "right":
        return text[:limit] + f"\n...({cut} more characters)"
    if side == "left":
        return f"({cut} characters before)...\n" + text[-limit:]
    return text[: limit // 2] + f"\n...({cut} characters)...\n" + text[-(limit - limit // 2):]


def tool_calls_of(message: Any) -> tuple[list[tuple[str, str, str]], bool, str | None]:
    """[(id, name, arguments JSON)], whether they came from the text, and a parse error (None if fine)."""
    calls = [(c.id or f"call_{uuid.uuid4().hex[:8]}", c.function.name, c.function.arguments or "{}")
             for c in (message.tool_calls or [])]
    if calls:
        return calls, False, None
    _, parsed, error = parse_tool_calls(message.content or "")  # the Gateway's parser, without vLLM's
    return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in parsed], True, error


def format_result(r: Any) -> str:
    """An ExecResult as the model sees it: stdout, then stderr, then why the run stopped (if it did not end)."""
    parts = [r.stdout.rstrip("\n")] if r.stdout else []
    if r.stderr:
        parts.append(r.stderr.rstrip("\n"))
    if r.error:
        parts.append(f"[sandbox: {r.error}]")
    return "\n".join(parts) if parts else "(no output: print what you want to see)"


async def agent(ctx: Any, config: dict) -> dict:
    """Up to max_turns assistant/tool turns; returns the last reply as the answer (reward None)."""
    max_turns = int(config.get("max_turns", 8))
    limit = int(config.get("max_tool_response_length", 4096))
    side = config.get("tool_response_truncate_side", "middle")
    code_timeout = config.get("code_timeout")
    tools = load_tools(config.get("tools"))
    schemas = [t.schema for t in tools.values()]
    messages = ctx.messages
    system = config.get("system_prompt", SYSTEM_PROMPT)
    if system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})

    meta: dict[str, Any] = {"turns": 0, "tool_calls": 0, "sandbox_errors": 0, "code_errors": 0,
                            "tool_errors": 0, "tool_call_parse_errors": 0, "stop": "max_turns", "events": []}
    answer = ""
    for _ in range(max_turns):
        t0 = time.time()
        reply = await ctx.llm.chat.completions.create(messages=messages, tools=schemas, **config.get("sampling", {}))
        meta["events"].append({"name": "llm", "start": t0, "end": time.time()})
        meta["turns"] += 1
        choice = reply.choices[0]
        msg = choice.message
        answer = msg.content or ""
        calls, from_text, parse_error = tool_calls_of(msg)
        if from_text:
            # The call is in the text: send the text back as it was generated, so the conversation stays token-exact.
            messages.append({"role": "assistant", "content": answer})
        else:
            messages.append({"role": "assistant", "content": answer, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]})
        if parse_error is not None:
            meta["tool_call_parse_errors"] += 1
            messages.append({"role": "user", "content": (
                f"Your tool call could not be parsed ({parse_error}). "
                'Write it as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.')})
            continue
        if not calls:
            meta["stop"] = "answer"
            break
        if choice.finish_reason == "length":
            meta["stop"] = "length"
            break
        for call_id, name, args in calls:
            meta["tool_calls"] += 1
            text = await _call_tool(ctx, config, tools, name, args, code_timeout, meta)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": truncate(text, limit, side)})
    return {"reward": None, "answer": answer, "metadata": meta}


async def _call_tool(ctx: Any, config: dict, tools: dict[str, _Tool], name: str, args: str,
                     code_timeout: float | None, meta: dict) -> str:
    t0 = time.time()
    try:
        tool = tools.get(name)
        if tool is None:
            meta["tool_errors"] += 1
            return f"Error: unknown tool {name!r} (available: {', '.join(tools)})"
        try:
            parsed = json.loads(args) if isinstance(args, str) else dict(args)
            if not isinstance(parsed, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as e:
            meta["tool_errors"] += 1
            return f"Error: the arguments of {name} are not a JSON object ({e})"
        if tool.handler is not None:
            try:
                out = await tool.handler(ctx, parsed)
            except Exception as e:  # noqa: BLE001 - a tool's failure is what the model sees, not a crash
                meta["tool_errors"] += 1
                return f"Error: {name} failed: {type(e).__name__}: {e}"
            return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)
        code = parsed.get("code")
        if not isinstance(code, str) or not code.strip():
            meta["tool_errors"] += 1
            return "Error: code_interpreter needs a non-empty string argument 'code'"
        s0 = time.time()
        try:
            result = await _sandbox(ctx).run(code, parsed.get("language", "python"), code_timeout)
        except SandboxFull as e:
            meta["sandbox_errors"] += 1
            return f"[sandbox: {e}]"
        finally:
            meta["events"].append({"name": "sandbox", "start": s0, "end": time.time(), "cat": "tool"})
        meta["sandbox_errors"] += result.error is not None
        meta["code_errors"] += result.error is None and result.exit_code != 0
        return format_result(result)
    finally:
        meta["events"].append({"name": f"tool:{name}", "start": t0, "end": time.time(), "cat": "tool"})
