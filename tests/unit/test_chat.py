"""The OpenAI chat format without a server: hermes tool-call parsing, message normalisation, response bodies."""

from __future__ import annotations

import json

import pytest

from rayrl.chat import (
    ApiError,
    extends,
    messages_of,
    normalize_messages,
    parse_tool_calls,
    prompt_of,
    response,
    stream_choices,
    vllm_tool_parser,
)

ONE = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TWO = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
       '<tool_call>\n{"name": "mul", "arguments": {"x": "3"}}\n</tool_call>')


@pytest.fixture(scope="module")
def hermes(tiny_model):
    from transformers import AutoTokenizer

    return vllm_tool_parser(AutoTokenizer.from_pretrained(tiny_model))


@pytest.mark.parametrize("use_vllm", [True, False], ids=["vllm-hermes", "fallback"])
def test_hermes_tool_calls_parse(hermes, use_vllm):
    t = hermes if use_vllm else None
    assert not use_vllm or t is not None  # vLLM's parser loads for the tiny model's tokenizer
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
def test_malformed_tool_call_is_content_plus_error(hermes, text):
    for t in (hermes, None):
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


@pytest.mark.parametrize("body, code", [({}, "missing_messages"), ({"messages": []}, "missing_messages"),
                                        ({"messages": "hi"}, "missing_messages"), ({"prompt": ""}, "missing_prompt"),
                                        ({"prompt": ["a", "b"]}, "missing_prompt")])
def test_request_checks(body, code):
    with pytest.raises(ApiError) as e:
        (prompt_of if code == "missing_prompt" else messages_of)(body)
    assert e.value.status == 400 and e.value.code == code
    assert prompt_of({"prompt": ["one"]}) == "one" and prompt_of({"prompt": [1, 2]}) == [1, 2]


def test_response_bodies_and_stream_chunks():
    msg = {"role": "assistant", "content": None,
           "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    chat = response(True, "policy", [{"index": 0, "message": msg, "finish_reason": "tool_calls", "logprobs": None}],
                    7, 3, "s-1")
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["system_fingerprint"] == "s-1" and chat["usage"] == {"prompt_tokens": 7, "completion_tokens": 3,
                                                                       "total_tokens": 10}
    delta, end = stream_choices(chat, True)
    assert delta[0]["delta"]["tool_calls"][0] == {"index": 0, **msg["tool_calls"][0]}
    assert end[0]["finish_reason"] == "tool_calls" and end[0]["delta"] == {}
    text = response(False, "policy", [{"index": 0, "text": "3", "logprobs": None, "finish_reason": "stop"}], 4, 1)
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-") and "system_fingerprint" not in text
    assert list(stream_choices(text, False)) == [[{"index": 0, "text": "3", "finish_reason": "stop", "logprobs": None}]]
