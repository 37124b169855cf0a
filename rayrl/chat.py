"""The OpenAI chat format, as the Gateway serves it and agents read it: errors, messages, tool calls, responses.

Plain functions over dicts; no tokenizer state lives here (a vLLM tool parser is built per tokenizer by its owner).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


# --- errors -------------------------------------------------------------------------------------

class ApiError(Exception):
    """An OpenAI-style error response: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                410: "invalid_request_error", 409: "invalid_request_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# --- messages -----------------------------------------------------------------------------------

def messages_of(body: dict) -> list:
    """A chat request's `messages`, or a 400 when they are missing or empty."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' is required and must be a non-empty list", "missing_messages", "messages")
    return msgs


def prompt_of(body: dict) -> str | list[int]:
    """A text completion request's `prompt`: one string or one list of token ids, else a 400."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not (isinstance(p, str) and p) and not (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        raise ApiError(400, "'prompt' is required: one string or one list of token ids", "missing_prompt", "prompt")
    return p


def _text(content: Any) -> str:
    """OpenAI content (str, None, or a list of parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: text content, tool-call arguments as dicts (like vLLM does)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "invalid_messages", "messages")
        n = {k: v for k, v in m.items() if v is not None}
        n["content"] = _text(m.get("content"))
        calls = []
        for c in m.get("tool_calls") or []:
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass  # leave the text: the template renders it as given
            calls.append({**c, "function": fn})
        if calls:
            n["tool_calls"] = calls
        out.append(n)
    return out


def _same(a: dict, b: dict, loose_assistant: bool) -> bool:
    """Two normalized messages are the same turn (assistant turns: same role is enough when loose)."""
    if a.get("role") != b.get("role"):
        return False
    if a["role"] == "assistant" and loose_assistant:
        return True
    if a["role"] == "assistant":
        na, nb = ([c.get("function", {}).get("name") for c in m.get("tool_calls") or []] for m in (a, b))
        return a["content"].strip() == b["content"].strip() or (bool(na) and na == nb)
    return a["content"] == b["content"] and a.get("tool_call_id") == b.get("tool_call_id")


def extends(history: list[dict], messages: list[dict], loose_assistant: bool = True) -> bool:
    """`messages` continues `history` (the previous request + our reply) with at least one new message."""
    return len(messages) > len(history) and all(_same(h, m, loose_assistant)
                                                for h, m in zip(history, messages, strict=False))


# --- tool calls ---------------------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def vllm_tool_parser(tokenizer: Any) -> Any | None:
    """vLLM's Hermes2ProToolParser for `tokenizer`, or None (no vLLM, or a tokenizer it refuses).

    Importing vLLM's parsers takes seconds: build one per tokenizer, when the first tool call shows up."""
    try:
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        logging.getLogger("vllm.tool_parsers.hermes_tool_parser").setLevel(logging.CRITICAL)  # we record errors
        return Hermes2ProToolParser(tokenizer)
    except Exception as e:  # noqa: BLE001 - no vLLM, or a tokenizer it refuses: the regex parses
        log.warning("vLLM's hermes tool parser is unavailable (%s); using the regex fallback", e)
        return None


def _parse_fallback(text: str) -> tuple[str | None, list[dict], str | None]:
    calls = []
    for i, (closed, open_) in enumerate(_TOOL_CALL.findall(text)):
        raw = closed or open_
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("a tool call must be a JSON object with a string 'name'")
            args = obj.get("arguments", {})
        except ValueError as e:  # JSONDecodeError is a ValueError
            return text, [], f"tool call {i}: {type(e).__name__}: {e}: {raw.strip()[:200]!r}"
        calls.append({"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)})
    content = text[: text.find("<tool_call>")]
    return content or None, calls, None


def parse_tool_calls(text: str, vllm_parser: Any = None) -> tuple[str | None, list[dict], str | None]:
    """Hermes-format tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen emits them).

    Returns (content, [{"id", "type", "function": {"name", "arguments"}}], parse_error). Text without a tool
    call is all content; a malformed call comes back as content with the error, never as an exception.
    With `vllm_parser` (see `vllm_tool_parser`) vLLM decides; the regex, same grammar, names what is wrong.
    """
    if "<tool_call>" not in text:
        return text, [], None
    content, calls, error = _parse_fallback(text)
    if vllm_parser is not None:
        info = vllm_parser.extract_tool_calls(text, None)
        if info.tools_called:
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in info.tool_calls]
            content, error = info.content, None
        elif error is None:
            error = "tool call: rejected by vLLM's hermes parser"
            content, calls = text, []
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c} for c in calls], error


# --- responses ----------------------------------------------------------------------------------

def finish_reason(engine_reason: str) -> str:
    """The engine's finish reason as OpenAI reports it (tool calls aside): "length" or "stop"."""
    return "length" if engine_reason == "length" else "stop"


def response(chat: bool, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
             session_id: str | None = None) -> dict:
    """A `chat.completion` (chat) or `text_completion` body; a chat one names its session in system_fingerprint."""
    body: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                            "model": model, "choices": choices}
    if chat:
        body["system_fingerprint"] = session_id
    body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
    return body


# a chat stream's first chunk: the role, before the engine answers
ROLE_DELTA = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]


def stream_chunk(chat: bool, chunk_id: str, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    """One chunk of a streamed response (`chat.completion.chunk` or `text_completion`); a stream's share one id."""
    c: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        c["usage"] = usage
    return c


def stream_choices(body: dict, chat: bool) -> Iterator[list[dict]]:
    """The choices of each stream chunk that carries a finished response `body` (after a chat stream's ROLE_DELTA)."""
    for c in body["choices"]:
        if not chat:
            yield [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"], "logprobs": None}]
            continue
        m = c["message"]
        delta: dict[str, Any] = {"content": m.get("content")}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(m["tool_calls"])]
        yield [{"index": c["index"], "delta": delta, "finish_reason": None, "logprobs": c["logprobs"]}]
        yield [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]
