"""SFT rows: verl's multi-turn SFT layout, checked and tokenized exactly as the Gateway records an RL episode.

A row (parquet or jsonl):
    messages  [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...]; an assistant message may
              carry OpenAI `tool_calls` ([{"type": "function", "function": {"name", "arguments"}}]), answered by
              `tool` messages
    tools     optional: OpenAI tool schemas ([{"type": "function", "function": {"name", ...}}]) or their JSON text

Tokens: each assistant turn is what the engine would have sampled after the chat template's generation prompt
(content, its <tool_call> blocks and the end-of-turn token), and everything between two assistant turns is what
`rayrl.sessions` inserts at RL time (the template's text after the end-of-turn token, the tool/user messages, the
next generation prompt). The loss mask is 1 on the assistant's tokens only, so an `Example` has the layout of a
Gateway `SessionRecord`, and the SFT tokens of a conversation equal the tokens the Gateway records for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rayrl.chat import ApiError, normalize_messages
from rayrl.data import DataError, _plain, _read_records, _short
from rayrl.sessions import Sessions
from rayrl.types import Generation

ROLES = ("system", "user", "assistant", "tool")


class RowError(DataError):
    """An SFT row that cannot be trained on; the message names the file and the row (one line)."""


@dataclass
class Example:
    """One tokenized conversation: the first prompt, then every later token (loss_mask 1 = the assistant's)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def load_examples(path: str, tok: Any, max_length: int, truncation: str = "error") -> list[Example]:
    """Every row of `path`, checked and tokenized with `tok` (its chat template as the Gateway uses it). A bad row
    raises RowError naming `path` and the row number (1-based; the line number in a .jsonl)."""
    out = []
    try:
        for n, raw in _read_records(path):
            where = f"{path} row {n}"
            messages, tools = check_row(raw, where)
            out.append(fit(tokenize(messages, tools, tok, where), max_length, truncation, where))
    except RowError:
        raise
    except ValueError as e:  # the file itself (not valid JSON, not parquet)
        raise RowError(str(e)) from None
    if not out:
        raise RowError(f"{path}: no rows")
    return out


def check_row(raw: Any, where: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a row, or a RowError saying what is wrong with it."""
    if not isinstance(raw, dict):
        raise RowError(f"{where}: must be an object with messages (and optional tools), got {_short(raw)}")
    raw = _plain(raw)
    msgs = raw.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RowError(f"{where}: messages must be a non-empty list of {{role, content}} messages, got {_short(msgs)}")
    tools = raw.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: tools is not valid JSON ({e.msg})") from None
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str)
                                          for t in tools)):
        raise RowError(f"{where}: tools must be a list of OpenAI tool schemas "
                       f"({{\"type\": \"function\", \"function\": {{\"name\": ...}}}}), got {_short(tools)}")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RowError(f"{where}: message {k} must have a role among {', '.join(ROLES)}, got {_short(m)}")
        m = {key: v for key, v in m.items() if v is not None}  # parquet structs carry every key of every row
        role, calls = m["role"], m.get("tool_calls") or []
        if not isinstance(m.get("content", ""), (str, list)):
            raise RowError(f"{where}: message {k} ({role}) content must be text, got {_short(m.get('content'))}")
        if role == "system" and k > 0:
            raise RowError(f"{where}: message {k}: a system message may only come first")
        if calls and role != "assistant":
            raise RowError(f"{where}: message {k}: only assistant messages may have tool_calls ({role} has)")
        for c in calls:
            _check_call(c, tools, f"{where}: message {k}")
        if role == "tool" and not (out and (out[-1].get("tool_calls") or out[-1]["role"] == "tool")):
            raise RowError(f"{where}: message {k}: a tool message must follow an assistant message with tool_calls")
        if role == "assistant" and not any(p["role"] in ("user", "tool") for p in out):
            raise RowError(f"{where}: message {k}: the first assistant message must follow a user message")
        out.append(m)
    if out[-1]["role"] != "assistant":
        raise RowError(f"{where}: the last message must be the assistant's (got {out[-1]['role']}): "
                       "nothing after it would be trained on")
    return out, tools


def _check_call(c: Any, tools: list[dict] | None, where: str) -> None:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RowError(f"{where}: a tool call must be {{\"function\": {{\"name\", \"arguments\"}}}}, got {_short(c)}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise RowError(f"{where}: tool call {fn['name']!r}: arguments are not valid JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise RowError(f"{where}: tool call {fn['name']!r}: arguments must be a JSON object, got {_short(args)}")
    # at RL time the Gateway parses tool calls only for requests that pass `tools`
    names = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in names:
        raise RowError(f"{where}: tool call {fn['name']!r} names no tool of the row's tools "
                       f"({', '.join(names) or 'none'})")


def tokenize(messages: list[dict], tools: list[dict] | None, tok: Any, where: str = "conversation") -> Example:
    """One conversation's tokens as the Gateway would record it, turn after turn (rayrl.sessions builds the prompts).

    Each assistant turn's tokens are the template's text for it after the generation prompt, up to its end-of-turn
    token, encoded, plus that token: what the engine samples before the Gateway parses the tool calls out."""
    sessions = Sessions(tok, max_model_len=1 << 62)
    s = sessions.open(where, budget=None, max_prompt=None, sampling={}, match=None)
    msgs = normalize_messages(messages)
    eos, eos_id = tok.eos_token, tok.eos_token_id
    try:
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = sessions.prompt_ids(s, msgs[:i], tools)
            before = sessions.render(msgs[:i], tools, True)
            after = sessions.render(msgs[: i + 1], tools, False)
            reply = after[len(before):]
            end = reply.rfind(eos) if eos else -1
            if not after.startswith(before) or end < 0:
                raise RowError(f"{where}: message {i}: the chat template does not render this assistant turn as the "
                               f"generation prompt followed by a reply ending in {eos!r}")
            # a template that drops the tools or the calls (SmolLM2's) would train the model on neither
            unseen = [t["function"]["name"] for t in tools or [] if t["function"]["name"] not in before]
            unseen += [c["function"]["name"] for c in m.get("tool_calls", []) if c["function"]["name"] not in reply]
            if unseen:
                raise RowError(f"{where}: message {i}: the chat template does not render tool {unseen[0]!r} (its "
                               "schema or its call); model.chat_template: hermes renders both")
            ids = sessions.encode(reply[:end]) + [eos_id]
            s.record.record(Generation(prompt, ids, [0.0] * len(ids), "stop", 0))
            s.history = msgs[: i + 1]
    except ApiError as e:  # the template refused the messages, or re-rendered an earlier turn differently
        raise RowError(f"{where}: {e.message}") from None
    rec = s.record
    return Example(prompt_ids=rec.prompt_ids, response_ids=rec.response_ids, loss_mask=rec.loss_mask)


def fit(ex: Example, max_length: int, truncation: str, where: str) -> Example:
    """`ex` within max_length tokens: unchanged, its tail cut off (truncation "right"), or a RowError."""
    if ex.num_tokens <= max_length:
        return ex
    keep = max_length - len(ex.prompt_ids)
    if truncation != "right" or keep < 1 or not any(ex.loss_mask[:keep]):
        raise RowError(f"{where}: {ex.num_tokens} tokens (first prompt {len(ex.prompt_ids)}), more than "
                       f"sft.max_length={max_length}" + ("" if truncation != "right" else
                                                         "; cut to it, no assistant token would be left"))
    return Example(ex.prompt_ids, ex.response_ids[:keep], ex.loss_mask[:keep])
