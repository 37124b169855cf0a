"""The ReTool agent with a fake `ctx.llm` (canned ChatCompletions) and a real local sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from rayrl.agents.tool_agent import CODE_INTERPRETER, agent, load_tools, tool_calls_of, truncate
from rayrl.config import SandboxConfig
from rayrl.sandbox import SandboxPool
from tests.helpers import FakeLLM, completion, make_ctx


def run_agent(replies, config=None, sandbox=None):
    llm = FakeLLM(replies)

    async def go():
        pool = sandbox or SandboxPool(SandboxConfig(timeout=10))
        try:
            return await agent(make_ctx(llm, pool), config or {})
        finally:
            await pool.close()
    return asyncio.run(go()), llm


def test_tool_call_then_final_answer() -> None:
    out, llm = run_agent([completion("Let me compute.", [("code_interpreter", {"code": "print(2 ** 5 + 2)"})]),
                          completion("The result is \\boxed{34}.")])
    assert out["reward"] is None and out["answer"] == "The result is \\boxed{34}."
    meta = out["metadata"]
    assert (meta["turns"], meta["tool_calls"], meta["sandbox_errors"], meta["stop"]) == (2, 1, 0, "answer")
    first, second = llm.requests
    assert first["tools"] == [CODE_INTERPRETER]
    assert first["messages"][0]["role"] == "system" and "\\boxed{}" in first["messages"][0]["content"]
    assistant, tool = second["messages"][-2:]
    assert assistant["tool_calls"][0]["function"]["name"] == "code_interpreter"
    assert tool == {"role": "tool", "tool_call_id": "call_0", "content": "34"}
    assert {e["name"] for e in meta["events"]} == {"llm", "sandbox", "tool:code_interpreter"}


def test_hermes_call_left_in_the_text_is_parsed() -> None:
    call = '{"name": "code_interpreter", "arguments": {"code": "print(7 * 6)"}}'
    text = f"I will run it.\n<tool_call>\n{call}\n</tool_call>"
    out, llm = run_agent([completion(text), completion("\\boxed{42}")])
    assert out["metadata"]["tool_calls"] == 1 and out["answer"] == "\\boxed{42}"
    assistant, tool = llm.requests[1]["messages"][-2:]
    assert assistant == {"role": "assistant", "content": text}  # sent back as generated
    assert tool["role"] == "tool" and tool["content"] == "42" and tool["tool_call_id"].startswith("call_")


def test_errors_are_fed_back_and_counted() -> None:
    replies = [completion(None, [("code_interpreter", {"code": "1/0"}),
                                 ("code_interpreter", {"code": "while True: pass"}),
                                 ("web_search", {"q": "x"})]),
               completion("<tool_call>{not json}</tool_call>"),
               completion("\\boxed{1}")]
    out, llm = run_agent(replies, {"code_timeout": 1.0})
    meta = out["metadata"]
    assert (meta["tool_calls"], meta["code_errors"], meta["sandbox_errors"], meta["tool_errors"]) == (3, 1, 1, 1)
    assert meta["tool_call_parse_errors"] == 1 and meta["turns"] == 3
    tools = [m for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert "ZeroDivisionError" in tools[0]["content"]
    assert "[sandbox: timeout after 1s]" in tools[1]["content"]
    assert "unknown tool 'web_search'" in tools[2]["content"]
    assert "could not be parsed" in llm.requests[2]["messages"][-1]["content"]


def test_calls_in_the_text_parse_as_the_gateway_parses_them() -> None:
    """Calls left in the text go through rayrl.chat's hermes parser, the Gateway's: same grammar, same errors."""
    text = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    msg = completion(text).choices[0].message
    calls, from_text, err = tool_calls_of(msg)
    assert from_text and err is None and [(n, json.loads(a)) for _, n, a in calls] == [("add", {"a": 1})]
    assert calls[0][0].startswith("call_")
    msg.content = '<tool_call>{"name": "add", "arguments": {}}'  # cut before the closing tag: still a call, as in vLLM
    assert [n for _, n, _ in tool_calls_of(msg)[0]] == ["add"]
    msg.content = "<tool_call>{not json}</tool_call>"
    calls, from_text, err = tool_calls_of(msg)
    assert calls == [] and from_text and err.startswith("tool call 0: JSONDecodeError")


def test_max_turns_and_truncation() -> None:
    loop = [completion(None, [("code_interpreter", {"code": "print('y' * 5000)"})]) for _ in range(2)]
    out, llm = run_agent(loop, {"max_turns": 2, "max_tool_response_length": 100})
    assert out["metadata"]["stop"] == "max_turns" and out["metadata"]["turns"] == 2 and len(llm.requests) == 2
    tool = llm.requests[1]["messages"][-1]
    assert tool["role"] == "tool" and len(tool["content"]) < 200 and "characters" in tool["content"]


async def lookup_tool(ctx, args: dict) -> dict:
    return {"capital": {"France": "Paris"}.get(args["country"], "?"), "task": ctx.task.task_id}


def test_custom_tool_from_yaml_style_config() -> None:
    schema = {"type": "function", "function": {"name": "lookup", "description": "Capital of a country.",
                                               "parameters": {"type": "object",
                                                              "properties": {"country": {"type": "string"}}}}}
    config = {"tools": [{"builtin": "code_interpreter"}, {"schema": schema, "handler": f"{__name__}:lookup_tool"}],
              "system_prompt": None}
    _, llm = run_agent([completion(None, [("lookup", {"country": "France"})]), completion("\\boxed{Paris}")], config)
    assert [t["function"]["name"] for t in llm.requests[0]["tools"]] == ["code_interpreter", "lookup"]
    assert llm.requests[0]["messages"][0]["role"] == "user"  # system_prompt: null keeps the prompt as is
    assert json.loads(llm.requests[1]["messages"][-1]["content"]) == {"capital": "Paris", "task": "g/0"}


@pytest.mark.parametrize("specs, fragment", [
    ([{"builtin": "browser"}], "only built-in tool is code_interpreter"),
    ([{"schema": {"type": "function"}, "handler": "x:y"}], "tools[0].schema must be an OpenAI function schema"),
    ([{"builtin": "code_interpreter"}, {"builtin": "code_interpreter"}], "declared twice"),
    ([{"schema": CODE_INTERPRETER | {"function": {"name": "t"}}, "handler": "rayrl.nope:f"}], "cannot import"),
])
def test_bad_tool_specs(specs, fragment) -> None:
    with pytest.raises(ValueError) as e:
        load_tools(specs)
    assert fragment in str(e.value)


def test_truncate_sides() -> None:
    text = "a" * 50 + "b" * 50
    assert truncate(text, 1000) == text
    assert truncate(text, 10, "right").startswith("a" * 10)
    assert truncate(text, 10, "left").endswith("b" * 10)
    mid = truncate(text, 10)
    assert mid.startswith("aaaaa") and mid.endswith("bbbbb") and "90 characters" in mid


def test_without_ctx_sandbox_the_code_tool_is_a_clear_error() -> None:
    # The rollout worker always sets ctx.sandbox (tests/integration/test_sandbox_actor.py); a caller that does not
    # gets an error naming it, never a pool with settings from nowhere.
    llm = FakeLLM([completion(None, [("code_interpreter", {"code": "print(5)"})]), completion("\\boxed{5}")])
    with pytest.raises(RuntimeError, match="ctx.sandbox"):
        asyncio.run(agent(make_ctx(llm, None), {}))
