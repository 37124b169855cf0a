"""ReTool-style agent: the model writes code, a sandbox runs it, the output goes back, up to `max_turns` replies.

    rollout:
      agent: rayrl.agents.tool_agent:agent
      agent_config:                        # the knobs of verl's multi-turn rollout, with verl's defaults
        max_turns: 8                       # model replies per episode (verl's max_assistant_turns = max_user_turns)
        max_parallel_calls: 1              # tool calls run per reply: the first k, at once; the rest are ignored
        max_tool_response_length: 256      # characters per tool result fed back
        tool_response_truncate_side: middle  # left: keep the head; right: keep the tail; middle: both ends
        system_prompt: null                # default: SYSTEM_PROMPT below; null sends the task's messages as they are
        tools:                             # default: the built-in code_interpreter alone
          - builtin: code_interpreter      # runs on ctx.sandbox (the job's `sandbox` section: backend, limits)
          - schema: {type: function, function: {name: lookup, description: ..., parameters: {...}}}
            handler: my_pkg.tools:lookup   # async def lookup(ctx, args: dict) -> str

Each turn is one `ctx.llm.chat.completions.create(messages=..., tools=...)` (hermes tool calls). Tool calls come
from `message.tool_calls`, or, when the server left them in the text, from `<tool_call>{json}</tool_call>` in
`message.content`. Results go back as `{"role": "tool", "tool_call_id": ..., "content": ...}`. The episode ends
at a reply without tool calls (the final answer, in \\boxed{}), a reply cut by length, or at the max_turns-th reply
(its calls are not run, as in verl). Code for the built-in code_interpreter is cleaned up as verl's recipe/retool
does it (`clean_code`) before either sandbox backend sees it.

reward is None: the RewardActor scores the answer (`reward.fn: retool` or `math_dapo` in the ReTool jobs).
metadata["num_turns"] counts turns as verl does (tool/user turns + model replies + 1); the rollout worker passes
it to the scorer as extra_info["num_turns"].
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
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


TRUNCATE_SIDES = ("left", "middle", "right")


@dataclass(frozen=True)
class Settings:
    """The agent's knobs (`rollout.agent_config`), checked; defaults are verl's multi_turn defaults."""

    max_turns: int = 8
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    code_timeout: float | None = None  # seconds per run; None: the sandbox section's timeout

    @classmethod
    def of(cls, config: dict) -> Settings:
        """Read from agent_config; a bad or unknown key raises ValueError naming rollout.agent_config.<key>."""
        known = set(cls.__dataclass_fields__) | _OTHER_KEYS
        for key in config:
            if key not in known:
                raise ValueError(f"rollout.agent_config.{key} is not a setting of rayrl.agents.tool_agent "
                                 f"(known: {', '.join(sorted(known))})")
        s = cls(**{f: config[f] for f in cls.__dataclass_fields__ if config.get(f) is not None})
        for name in ("max_turns", "max_parallel_calls", "max_tool_response_length"):
            value = getattr(s, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.agent_config.{name} must be an integer >= 1, got {value!r}")
        if s.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"rollout.agent_config.tool_response_truncate_side must be one of "
                             f"{', '.join(TRUNCATE_SIDES)}, got {s.tool_response_truncate_side!r}")
        timeout = s.code_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"rollout.agent_config.code_timeout must be a number of seconds > 0, got {timeout!r}")
        return s


_OTHER_KEYS = {"tools", "system_prompt", "sampling"}  # read by agent() itself


def check_config(config: dict) -> None:
    """rollout.agent_config checked before any actor starts (rayrl.config calls it): the settings and the tools."""
    Settings.of(config)
    load_tools(config.get("tools"))


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """verl's cut of a tool response longer than `limit` characters, with verl's markers: "left" keeps the first
    `limit` characters, "right" the last `limit`, "middle" the first and last `limit // 2`."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


_FENCE = re.compile(r"```python(.*?)```", re.DOTALL)  # recipe/retool's pattern


def clean_code(code: str) -> str:
    """A code_interpreter argument cleaned up as verl's recipe/retool (CustomSandboxFusionTool) does it: the first
    ```python fenced block when there is one, and the last statement printed when it is a bare expression (a script
    shows nothing for it, a notebook would). The recipe wraps any last line not starting with `print`, which breaks
    `x = 1` or an indented line; here only a bare expression is wrapped, so valid code stays valid."""
    fenced = _FENCE.search(code)
    if fenced:
        code = fenced.group(1).strip()
    return _print_last_expression(code)


def _print_last_expression(code: str) -> str:
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, RecursionError):
        return code  # the sandbox reports the error, on the code as written
    last = body[-1] if body else None
    if not isinstance(last, ast.Expr):
        return code
    value = last.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return code
    raw = code.encode()  # ast's column offsets count UTF-8 bytes
    starts = [0]
    for line in raw.split(b"\n"):
        starts.append(starts[-1] + len(line) + 1)
    a = starts[last.lineno - 1] + last.col_offset
    b = starts[last.end_lineno - 1] + last.end_col_offset
    out = (raw[:a] + b"print(" + raw[a:b] + b")" + raw[b:]).decode()
    try:
        ast.parse(out)
    except (SyntaxError, ValueError, RecursionError):
        return code  # line endings ast counts differently (a lone \r): leave the code as written
    return out


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
    settings = Settings.of(config)
    tools = load_tools(config.get("tools"))
    schemas = [t.schema for t in tools.values()]
    messages = ctx.messages
    system = config.get("system_prompt", SYSTEM_PROMPT)
    if system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})

    meta: dict[str, Any] = {"turns": 0, "tool_turns": 0, "num_turns": 1, "tool_calls": 0, "tool_calls_dropped": 0,
                            "sandbox_errors": 0, "code_errors": 0, "tool_errors": 0, "tool_call_parse_errors": 0,
                            "stop": "", "events": []}
    answer = ""
    while True:
        t0 = time.time()
        reply = await ctx.llm.chat.completions.create(messages=messages, tools=schemas, **config.get("sampling", {}))
        meta["events"].append({"name": "llm", "start": t0, "end": time.time()})
        meta["turns"] += 1
        meta["num_turns"] += 1
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
        if choice.finish_reason == "length":
            meta["stop"] = "length"
            break
        if not calls and parse_error is None:
            meta["stop"] = "answer"
            break
        if meta["turns"] >= settings.max_turns:
            meta["stop"] = "max_turns"  # verl ends at this reply too: its calls are not run
            break
        if parse_error is not None:
            meta["tool_call_parse_errors"] += 1
            messages.append({"role": "user", "content": (
                f"Your tool call could not be parsed ({parse_error}). "
                'Write it as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.')})
        else:
            run, dropped = calls[: settings.max_parallel_calls], calls[settings.max_parallel_calls:]
            meta["tool_calls"] += len(run)
            meta["tool_calls_dropped"] += len(dropped)
            texts = await asyncio.gather(*(_call_tool(ctx, tools, name, args, settings.code_timeout, meta)
                                           for _, name, args in run))
            for (call_id, _, _), text in zip(run, texts, strict=True):
                messages.append({"role": "tool", "tool_call_id": call_id, "content": truncate(
                    text, settings.max_tool_response_length, settings.tool_response_truncate_side)})
        meta["tool_turns"] += 1  # the tool results (or the parse-error note) are one user turn in verl's count
        meta["num_turns"] += 1
    return {"reward": None, "answer": answer, "metadata": meta}


async def _call_tool(ctx: Any, tools: dict[str, _Tool], name: str, args: str, code_timeout: float | None,
                     meta: dict) -> str:
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
        language = parsed.get("language", "python")
        if language == "python":
            code = clean_code(code)
        s0 = time.time()
        span = {"name": "sandbox", "start": s0, "cat": "tool"}
        try:
            result = await _sandbox(ctx).run(code, language, code_timeout)
            span["args"] = {"run_s": result.duration}  # the run itself; the span also holds the wait for a slot
        except SandboxFull as e:
            meta["sandbox_errors"] += 1
            return f"[sandbox: {e}]"
        finally:
            meta["events"].append({**span, "end": time.time()})
        meta["sandbox_errors"] += result.error is not None
        meta["code_errors"] += result.error is None and result.exit_code != 0
        return format_result(result)
    finally:
        meta["events"].append({"name": f"tool:{name}", "start": t0, "end": time.time(), "cat": "tool"})
