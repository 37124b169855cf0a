"""Gateway logic without Ray or an engine: tool-call parsing, session binding, prompt building, recording, limits."""

from __future__ import annotations

import json

import pytest

from rayrl.actors.gateway import ApiError, Gateway, SessionRecord, extends, normalize_messages, parse_tool_calls
from rayrl.config import load_config
from rayrl.types import Generation
from tests.conftest import tiny_overrides

ONE = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TWO = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
       '<tool_call>\n{"name": "mul", "arguments": {"x": "3"}}\n</tool_call>')


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("use_vllm", [True, False], ids=["vllm-hermes", "fallback"])
def test_hermes_tool_calls_parse(tok, use_vllm):
    t = tok if use_vllm else None
    content, calls, err = parse_tool_calls(ONE, t)
    assert err is None and content is None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}

    content, calls, err = parse_tool_calls(TWO, t)
    assert err is None and content == "Let me add.\n"
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": "3"}

    assert parse_tool_calls("no tools here", t) == ("no tools here", [], None)
    # an unclosed tag at the end of the output (cut at max_tokens after a complete JSON) still parses, like vLLM
    _, calls, err = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {}}', t)
    assert err is None and calls[0]["function"]["name"] == "add"


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>',  # bad JSON
                                  '<tool_call>\n["add"]\n</tool_call>',  # not an object
                                  'ok <tool_call>{"arguments": {}}</tool_call>'])  # no name
def test_malformed_tool_call_is_content_plus_error(tok, text):
    for t in (tok, None):
        content, calls, err = parse_tool_calls(text, t)
        assert content == text and calls == [] and err and err.startswith("tool call 0")


def test_normalize_and_extends():
    msgs = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}])
    assert msgs[0]["content"] == "ab" and msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # templates want a dict
    assert extends(msgs[:2], msgs) and not extends(msgs, msgs) and not extends(msgs[1:], msgs)
    other = [dict(msgs[0], content="changed")] + msgs[1:]
    assert not extends(msgs[:2], other)
    reply = [msgs[0], {"role": "assistant", "content": "something else"}]
    assert extends(reply, msgs) and not extends(reply, msgs, loose_assistant=False)
    with pytest.raises(ApiError) as e:
        normalize_messages([{"content": "no role"}])
    assert e.value.status == 400


def test_record_is_one_sequence_and_refuses_rewrites():
    rec = SessionRecord("s", "t")
    rec.record(Generation([1, 2, 3], [10, 11], [-0.5, -0.25], "stop", 4))
    rec.record(Generation([1, 2, 3, 10, 11, 7, 8], [12], [-1.0], "length", 5))
    assert rec.prompt_ids == [1, 2, 3] and rec.response_ids == [10, 11, 7, 8, 12]
    assert rec.loss_mask == [1, 1, 0, 0, 1] and rec.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert rec.policy_version == 4 and rec.finish_reason == "length" and [t.env_len for t in rec.turns] == [0, 2]
    with pytest.raises(ValueError, match="rewritten"):
        rec.record(Generation([1, 2, 9], [5], [-1.0], "stop", 5))


@pytest.fixture()
def gw(tiny_model):
    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{"engine.max_model_len": 64, "data.max_prompt_length": 40, "rollout.max_response_length": 24}))
    return Gateway(cfg, tiny_model, engines=[])


def test_binding_order_path_key_prefix(gw):
    a, _key_a, url_a = gw.open_session("a", match="What is 1 + 1?")
    b, key_b, _ = gw.open_session("b", match="What is 2 + 2?")
    assert url_a.endswith(f"/sessions/{a}/v1")
    msgs = normalize_messages([{"role": "user", "content": "Q: What is 2 + 2?"}])
    assert gw.bind(a, key_b, msgs) is gw.sessions[a]  # path first
    assert gw.bind(None, key_b, []) is gw.sessions[b]  # then key
    assert gw.bind(None, "sk-fixed", msgs) is gw.sessions[b]  # then the task text
    assert gw.bind(None, "sk-fixed", normalize_messages([{"role": "user", "content": "hello"}])) is None
    gw.close_session(a)
    with pytest.raises(ApiError) as e:
        gw.bind(a, None, msgs)
    assert e.value.status == 410
    with pytest.raises(ApiError) as e:
        gw.bind("s-unknown", None, msgs)
    assert e.value.status == 404


def test_follow_up_prompt_reuses_exact_tokens(gw, tok):
    """Turn 2's prompt = every token of turn 1 (prompt + the engine's sampled ids, which need not be what the
    tokenizer would produce for that text) + the template's tokens for the new messages only."""
    sid, _, _ = gw.open_session("t")
    s = gw.sessions[sid]
    msgs = normalize_messages([{"role": "user", "content": "What is 12 + 35?"}])
    p1 = gw.prompt_ids(s, msgs, None)
    sampled = tok.encode("4", add_special_tokens=False) + tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    s.record.record(Generation(p1, sampled, [-0.1] * len(sampled), "stop", 0))
    s.history = msgs + [{"role": "assistant", "content": "47"}]
    follow = msgs + [{"role": "assistant", "content": "47", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                     {"role": "tool", "content": "ok"}]
    p2 = gw.prompt_ids(s, normalize_messages(follow), None)
    assert p2[: len(p1) + len(sampled)] == p1 + sampled
    assert tok.decode(p2[len(p1) + len(sampled):]) == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ApiError) as e:
        gw.prompt_ids(s, normalize_messages([{"role": "user", "content": "something else"}] + follow[1:]), None)
    assert e.value.code == "conversation_rewritten"


def test_limits(gw):
    sid, _, _ = gw.open_session("t", budget=10, max_prompt=40)
    s = gw.sessions[sid]
    assert gw._limits(s, [1] * 20, None, 1) == 10  # the trajectory budget caps max_tokens
    assert gw._limits(None, [1] * 20, None, 1) == 44  # unbound: the rest of the context
    for prompt, max_tokens, n, code in [([1] * 64, None, 1, "context_length_exceeded"),
                                        ([1] * 20, 50, 1, "context_length_exceeded"),
                                        ([1] * 41, None, 1, "context_length_exceeded"),  # data.max_prompt_length
                                        ([1] * 20, None, 2, "invalid_n"), ([1] * 20, 0, 1, "invalid_value")]:
        with pytest.raises(ApiError) as e:
            gw._limits(s, prompt, max_tokens, n)
        assert e.value.status == 400 and e.value.code == code
    with pytest.raises(ApiError) as e:
        gw.check_model({"model": "gpt-4o"})
    assert e.value.status == 404
    gw.check_model({"model": "policy"})
    gw.check_model({"model": gw.model_path})


def test_response_choice_parses_tool_calls_from_engine_tokens(gw, tok):
    """What the Gateway answers for sampled tokens holding hermes tool calls: OpenAI tool_calls and finish_reason
    tool_calls; a malformed call: the text as content, finish_reason stop, and the error (which the session
    records) — never an exception."""
    from tests.gateway_agents import TOOLS

    def gen(text):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Generation([1], ids, [-0.1] * len(ids), "stop", 0)

    choice, err = gw._choice(0, gen("Adding." + ONE), TOOLS, "auto", False)
    assert err is None and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Adding."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    choice, err = gw._choice(0, gen(bad), TOOLS, "auto", True)
    assert err and choice["finish_reason"] == "stop" and choice["message"]["content"] == bad
    assert "tool_calls" not in choice["message"] and len(choice["logprobs"]["content"]) == len(gen(bad).token_ids)
    choice, err = gw._choice(0, gen(ONE), TOOLS, "none", False)  # tool_choice none: no parsing
    assert err is None and "tool_calls" not in choice["message"]
    assert gw.counts["parse_errors"] == 1
