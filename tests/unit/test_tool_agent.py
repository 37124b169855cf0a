"""The ReTool agent with a fake `ctx.llm` (canned ChatCompletions) and a real local sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from rayrl.agents.tool_agent import CODE_INTERPRETER, Settings, agent, clean_code, load_tools, tool_calls_of, truncate
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
    [span] = [e for e in meta["events"] if e["name"] == "sandbox"]  # the run alone, inside the call's span
    assert 0 < span["args"]["run_s"] <= span["end"] - span["start"]


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
    out, llm = run_agent(replies, {"code_timeout": 1.0, "max_parallel_calls": 3})
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
    loop = [completion(None, [("code_interpreter", {"code": "print('x' * 60 + 'y' * 5000 + 'z' * 60)"})])
            for _ in range(2)]
    out, llm = run_agent(loop, {"max_turns": 2, "max_tool_response_length": 100})
    meta = out["metadata"]
    assert meta["stop"] == "max_turns" and meta["turns"] == 2 and len(llm.requests) == 2
    # verl's max_assistant_turns: the episode ends at the 2nd reply, whose call is not run
    assert meta["tool_calls"] == 1 and meta["tool_turns"] == 1
    assert meta["num_turns"] == 4  # verl's count: 1 tool turn + 2 replies + 1
    tool = llm.requests[1]["messages"][-1]
    assert tool["role"] == "tool" and tool["content"] == "x" * 50 + "...(truncated)..." + "z" * 50


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


def test_truncate_sides_as_verl() -> None:
    """verl's ToolAgentLoop: "left" keeps the head, "right" the tail, "middle" both ends (limit // 2 each)."""
    text = "a" * 50 + "b" * 50
    assert truncate(text, 100) == text and truncate(text, 1000, "left") == text
    assert truncate(text, 10, "left") == "a" * 10 + "...(truncated)"
    assert truncate(text, 10, "right") == "(truncated)..." + "b" * 10
    assert truncate(text, 10) == truncate(text, 10, "middle") == "a" * 5 + "...(truncated)..." + "b" * 5
    assert truncate(text, 1) == "...(truncated)..."  # limit // 2 == 0: nothing of either end


@pytest.mark.parametrize("side, want", [("left", "H" * 20 + "...(truncated)"), ("right", "(truncated)..." + "T" * 20),
                                        ("middle", "H" * 10 + "...(truncated)..." + "T" * 10)])
def test_tool_response_truncate_side_reaches_the_model(side: str, want: str) -> None:
    code = "print('H' * 30 + '.' * 100 + 'T' * 30)"
    _, llm = run_agent([completion(None, [("code_interpreter", {"code": code})]), completion("\\boxed{0}")],
                       {"max_tool_response_length": 20, "tool_response_truncate_side": side})
    assert llm.requests[1]["messages"][-1]["content"] == want


def test_defaults_are_verls() -> None:
    s = Settings.of({})
    assert (s.max_parallel_calls, s.max_tool_response_length, s.tool_response_truncate_side) == (1, 256, "middle")
    _, llm = run_agent([completion(None, [("code_interpreter", {"code": "print('q' * 1000)"})]),
                        completion("\\boxed{0}")])
    assert llm.requests[1]["messages"][-1]["content"] == "q" * 128 + "...(truncated)..." + "q" * 128


@pytest.mark.parametrize("config, fragment", [
    ({"max_turns": 0}, "rollout.agent_config.max_turns must be an integer >= 1, got 0"),
    ({"max_parallel_calls": 1.5}, "rollout.agent_config.max_parallel_calls must be an integer >= 1"),
    ({"max_tool_response_length": True}, "rollout.agent_config.max_tool_response_length must be an integer"),
    ({"tool_response_truncate_side": "top"}, "tool_response_truncate_side must be one of left, middle, right"),
    ({"code_timeout": -1}, "rollout.agent_config.code_timeout must be a number of seconds > 0"),
    ({"max_tool_response_len": 10}, "rollout.agent_config.max_tool_response_len is not a setting"),
])
def test_bad_settings_are_one_line_errors(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        Settings.of(config)
    assert fragment in str(e.value) and "\n" not in str(e.value)


ACTIVE = {"now": 0, "most": 0}


async def slow_tool(ctx, args: dict) -> str:
    ACTIVE["now"] += 1
    ACTIVE["most"] = max(ACTIVE["most"], ACTIVE["now"])
    await asyncio.sleep(0.2)
    ACTIVE["now"] -= 1
    return f"done {args['i']}"


SLOW = {"schema": {"type": "function", "function": {"name": "slow", "description": "Waits.",
                                                    "parameters": {"type": "object"}}},
        "handler": f"{__name__}:slow_tool"}


@pytest.mark.parametrize("k", [1, 2])
def test_max_parallel_calls_runs_the_first_k_at_once(k: int) -> None:
    """verl's ToolAgentLoop runs tool_calls[:max_parallel_calls] together (asyncio.gather) and ignores the rest."""
    ACTIVE.update(now=0, most=0)
    three = completion(None, [("slow", {"i": 0}), ("slow", {"i": 1}), ("slow", {"i": 2})])
    out, llm = run_agent([three, completion("\\boxed{0}")], {"tools": [SLOW], "max_parallel_calls": k})
    results = [m for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in results] == [f"done {i}" for i in range(k)]
    assert [m["tool_call_id"] for m in results] == [f"call_{i}" for i in range(k)]
    assert len(llm.requests[1]["messages"][-k - 1]["tool_calls"]) == 3  # the reply itself stays as generated
    assert ACTIVE["most"] == k
    assert (out["metadata"]["tool_calls"], out["metadata"]["tool_calls_dropped"]) == (k, 3 - k)
    assert out["metadata"]["num_turns"] == 4  # one tool turn, however many calls it ran


def test_num_turns_is_verls_count() -> None:
    """user/tool turns + assistant turns + 1 (verl's AgentLoopOutput.num_turns): 2 for a plain answer."""
    out, _ = run_agent([completion("\\boxed{34}")])
    assert out["metadata"]["num_turns"] == 2 and out["metadata"]["stop"] == "answer"
    calls = [completion(None, [("code_interpreter", {"code": f"print({i})"})]) for i in range(3)]
    out, _ = run_agent([*calls, completion("\\boxed{2}")])
    assert out["metadata"]["num_turns"] == 8 and out["metadata"]["tool_turns"] == 3


@pytest.mark.parametrize("code, want", [
    ("```python\nx = 6 * 7\nx\n```", "x = 6 * 7\nprint(x)"),  # the fenced block, its last expression printed
    ("Let me run:\n```python\nprint(1)\n```\nand\n```python\n2\n```", "print(1)"),  # the first block only
    ("a = [1, 2]\nsum(a)", "a = [1, 2]\nprint(sum(a))"),
    ("print(3)", "print(3)"),
    ("x = 5", "x = 5"),  # not an expression: left alone (the recipe would write print(x = 5))
    ("for i in range(2):\n    i", "for i in range(2):\n    i"),  # the last statement is the loop
    ("y = 2; y ** 2", "y = 2; print(y ** 2)"),
    ("(1 +\n 2)", "print((1 +\n 2))"),  # a multi-line expression
    ("s = 'é'; s + 'ü'", "s = 'é'; print(s + 'ü')"),  # column offsets count bytes
    ("def f(:\n  pass", "def f(:\n  pass"),  # a syntax error: as written, the sandbox reports it
    ("```python\n\n```", ""),
    ("", ""),
])
def test_clean_code_as_the_recipe(code: str, want: str) -> None:
    assert clean_code(code) == want


def test_both_backends_see_cleaned_code_and_answer_alike(monkeypatch) -> None:
    """The clean-up runs in the agent, before the sandbox: the local backend and E2B (the real SDK against the fake
    E2B server of test_sandbox_e2b) give the model the same observation."""
    pytest.importorskip("e2b_code_interpreter")
    import threading
    from http.server import ThreadingHTTPServer

    from tests.unit.test_sandbox_e2b import KEY, FakeE2B

    code = "Compute it:\n```python\nimport math\nmath.factorial(5) + len('ü')\n```"
    replies = lambda: [completion(None, [("code_interpreter", {"code": code})]), completion("\\boxed{121}")]  # noqa: E731
    _, local = run_agent(replies())
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeE2B)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("RAYRL_TEST_E2B_KEY", KEY)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        e2b = SandboxPool(SandboxConfig(backend="e2b", e2b_api_key_env="RAYRL_TEST_E2B_KEY", e2b_api_url=url,
                                        e2b_sandbox_url=url, max_concurrency=1))
        _, remote = run_agent(replies(), sandbox=e2b)
    finally:
        server.shutdown()
        server.server_close()
    assert local.requests[1]["messages"][-1]["content"] == "121"
    assert remote.requests[1]["messages"][-1] == local.requests[1]["messages"][-1]


def test_without_ctx_sandbox_the_code_tool_is_a_clear_error() -> None:
    # The rollout worker always sets ctx.sandbox (tests/integration/test_sandbox_actor.py); a caller that does not
    # gets an error naming it, never a pool with settings from nowhere.
    llm = FakeLLM([completion(None, [("code_interpreter", {"code": "print(5)"})]), completion("\\boxed{5}")])
    with pytest.raises(RuntimeError, match="ctx.sandbox"):
        asyncio.run(agent(make_ctx(llm, None), {}))
