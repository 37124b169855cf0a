"""Gateway: the OpenAI chat API over HTTP in front of the Engines, recording every call token for token.

Agents (in-process functions through `ctx.llm`, or external services with their own config) talk
plain OpenAI; the Gateway renders prompts with the model's chat template, sends token ids to the
least-loaded Engine (sticky per session, so prefix caches hit), and records per session the exact
prompt ids, sampled ids, engine logprobs and the loss mask (model tokens 1, tool/user/env tokens 0).
The learner trains on that record; nothing is re-tokenized afterwards.

A request is bound to a session by, in order: the URL path (`/sessions/{sid}/v1/...`), the API key
(`Authorization: Bearer <session key>`), or its conversation prefix (for services whose base URL and
key are fixed in their own config). An unbound request is served but not recorded.

`Gateway` is a plain class holding the logic; `GatewayActor` is the Ray actor, whose event loop also
runs the uvicorn server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray

from rayrl.actors.engine import Sampling
from rayrl.config import Config
from rayrl.types import Generation

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


# --- session records ------------------------------------------------------------------------------

@dataclass
class Turn:
    """One engine call of a session, as the engine returned it."""

    env_len: int  # tokens inserted before this turn's prompt end (tool/user messages + template), masked 0
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    engine: int
    tool_calls: int = 0
    parse_error: str | None = None
    start: float = 0.0  # wall clock (time.time()) of the engine call, for the trace
    end: float = 0.0


@dataclass
class SessionRecord:
    """What `close_session` returns: one episode's calls as one token sequence, ready for a Trajectory."""

    session_id: str
    task_id: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)  # model tokens and env tokens between turns
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the engine, 0 = env/tool/template tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 where loss_mask is 0
    num_turns: int = 0
    policy_version: int | None = None
    finish_reason: str = ""
    turns: list[Turn] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)  # malformed tool calls, per turn that had one
    errors: list[str] = field(default_factory=list)  # requests of this session that were refused (4xx)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def record(self, gen: Generation, engine: int = 0, start: float = 0.0) -> Turn:
        """Append one call. Its prompt must extend every token so far (append-only conversations only)."""
        env: list[int] = []
        if self.num_turns == 0:
            self.prompt_ids = list(gen.prompt_ids)
            self.policy_version = gen.policy_version
        else:
            prev = self.all_ids
            if gen.prompt_ids[: len(prev)] != prev:
                raise ValueError("the conversation was rewritten between turns (the new prompt does not extend the "
                                 "previous tokens); only append-only conversations can be trained on")
            env = gen.prompt_ids[len(prev):]  # tool/user tokens between turns: in context, not trained
            self.response_ids += env
            self.loss_mask += [0] * len(env)
            self.logprobs += [0.0] * len(env)
        self.response_ids += gen.token_ids
        self.loss_mask += [1] * len(gen.token_ids)
        self.logprobs += gen.logprobs
        self.num_turns += 1
        self.finish_reason = gen.finish_reason
        turn = Turn(env_len=len(env), token_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
                    finish_reason=gen.finish_reason, engine=engine, start=start, end=time.time())
        self.turns.append(turn)
        return turn


@dataclass
class _Session:
    record: SessionRecord
    key: str
    budget: int | None  # response tokens (model + env) the whole episode may use
    max_prompt: int | None  # first prompt's limit
    sampling: dict[str, float]  # defaults: temperature, top_p
    match: str | None  # text the first request must contain, for prefix binding (external services)
    engine: int | None = None  # sticky engine index, chosen at the first call
    history: list[dict] | None = None  # the last request's messages + the assistant reply we returned
    tools: list[dict] | None = None
    opened: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time: the record is one sequence


# --- messages, templates, tool calls ----------------------------------------------------------------

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
    return len(messages) > len(history) and all(_same(h, m, loose_assistant) for h, m in zip(history, messages))


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_hermes = None  # vLLM's Hermes2ProToolParser, built on first use (importing vLLM's parsers takes seconds)


def _parse_fallback(text: str) -> tuple[str | None, list[dict], str | None]:
    calls = []
    for i, (closed, open_) in enumerate(_TOOL_CALL.findall(text)):
        raw = closed or open_
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("a tool call must be a JSON object with a string 'name'")  # noqa: TRY004
            args = obj.get("arguments", {})
        except (ValueError, json.JSONDecodeError) as e:
            return text, [], f"tool call {i}: {type(e).__name__}: {e}: {raw.strip()[:200]!r}"
        calls.append({"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)})
    content = text[: text.find("<tool_call>")]
    return content or None, calls, None


def parse_tool_calls(text: str, tokenizer=None) -> tuple[str | None, list[dict], str | None]:
    """Hermes-format tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen emits them).

    Returns (content, [{"id", "type", "function": {"name", "arguments"}}], parse_error). Text without a tool
    call is all content; a malformed call comes back as content with the error, never as an exception.
    vLLM's own parser is used when it loads; the regex fallback names what is wrong.
    """
    global _hermes
    if "<tool_call>" not in text:
        return text, [], None
    if _hermes is None and tokenizer is not None:
        try:
            from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

            logging.getLogger("vllm.tool_parsers.hermes_tool_parser").setLevel(logging.CRITICAL)  # we record errors
            _hermes = Hermes2ProToolParser(tokenizer)
        except Exception as e:  # noqa: BLE001 - no vLLM, or a tokenizer it refuses: the fallback parses
            log.warning("vLLM's hermes tool parser is unavailable (%s); using the regex fallback", e)
            _hermes = False
    content, calls, error = _parse_fallback(text)  # names the error; same grammar as vLLM's
    if _hermes:
        info = _hermes.extract_tool_calls(text, None)
        if info.tools_called:
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in info.tool_calls]
            content, error = info.content, None
        elif error is None:
            error = "tool call: rejected by vLLM's hermes parser"
            content, calls = text, []
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c} for c in calls], error


# --- the gateway --------------------------------------------------------------------------------

class Gateway:
    """Plain class (sessions, prompts, routing, recording); `GatewayActor` below is the Ray actor."""

    MAX_N_UNBOUND = 8  # n > 1 only for unbound requests: a session is one trajectory

    def __init__(self, cfg: Config, model_path: str, engines: list, model_name: str | None = None):
        from transformers import AutoTokenizer

        self.cfg, self.model_path, self.engines = cfg, model_path, engines
        self.tok = AutoTokenizer.from_pretrained(model_path)
        g = cfg.gateway
        self.model_name = model_name or g.model_name
        self.aliases = {self.model_name, model_path, model_path.rstrip("/").split("/")[-1]}
        self.max_model_len = cfg.engine.max_model_len
        self.timeout = g.request_timeout
        self.sessions: dict[str, _Session] = {}
        self.keys: dict[str, str] = {}  # api key -> session id
        self.closed: OrderedDict[str, float] = OrderedDict()  # recently closed ids, for a 410 instead of a 404
        self.load = [0] * len(engines)  # requests in flight per engine
        self.counts: dict[str, int] = {"requests": 0, "unbound_requests": 0, "recorded_turns": 0, "parse_errors": 0,
                                       "aborted": 0, "errors_4xx": 0, "errors_5xx": 0, "tokens_out": 0}
        self.base_url = ""  # set by start()
        self._server = None
        self._local = None  # in-process client of the app, for request()

    # sessions ---------------------------------------------------------------------------------
    def open_session(self, task_id: str, budget: int | None = None, max_prompt: int | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     match: str | None = None) -> tuple[str, str, str]:
        """A new session -> (session_id, api_key, base_url of its OpenAI API: `<gateway>/sessions/<sid>/v1`)."""
        sid = f"s-{uuid.uuid4().hex}"
        key = f"rk-{secrets.token_urlsafe(24)}"
        r = self.cfg.rollout
        self.sessions[sid] = _Session(record=SessionRecord(session_id=sid, task_id=task_id), key=key, budget=budget,
                                      max_prompt=max_prompt, match=match,
                                      sampling={"temperature": r.temperature if temperature is None else temperature,
                                                "top_p": r.top_p if top_p is None else top_p})
        self.keys[key] = sid
        return sid, key, f"{self.base_url}/sessions/{sid}/v1"

    def close_session(self, session_id: str) -> SessionRecord:
        """End a session; its record is what the learner trains on. Later calls to it get a 410."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            raise KeyError(f"no open session {session_id!r}")
        self.keys.pop(s.key, None)
        self.closed[session_id] = time.monotonic()
        while len(self.closed) > 100_000:
            self.closed.popitem(last=False)
        return s.record

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "open_sessions": len(self.sessions), "inflight": list(self.load)}

    def _session(self, sid: str) -> _Session:
        if sid in self.sessions:
            return self.sessions[sid]
        if sid in self.closed:
            raise ApiError(410, f"session {sid} is closed", "session_closed")
        raise ApiError(404, f"session {sid} does not exist", "session_not_found")

    def bind(self, path_sid: str | None, api_key: str | None, messages: list[dict] | None) -> _Session | None:
        """The session a request belongs to: by URL path, then API key, then conversation prefix; else None."""
        if path_sid is not None:
            return self._session(path_sid)
        if api_key and api_key in self.keys:
            return self.sessions[self.keys[api_key]]
        if not messages:
            return None
        # A continuing conversation: the longest history it extends (assistant replies must match too).
        best = None
        for s in self.sessions.values():
            if (s.history and extends(s.history, messages, loose_assistant=False) and not s.lock.locked()
                    and (best is None or len(s.history) > len(best.history))):
                best = s
        if best is not None:
            return best
        # A new one: the oldest fresh session whose task text the conversation contains.
        texts = [m["content"] for m in messages if m.get("role") in ("user", "system")]
        for s in self.sessions.values():  # insertion order = opening order
            if s.match and s.record.num_turns == 0 and not s.lock.locked() and any(s.match in t for t in texts):
                return s
        return None

    # prompts ----------------------------------------------------------------------------------
    def _render(self, messages: list[dict], tools: list[dict] | None, gen_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=gen_prompt,
                                                tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja errors on odd messages are the client's
            raise ApiError(400, f"the chat template cannot render these messages: {e}", "invalid_messages",
                           "messages") from None

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def prompt_ids(self, s: _Session | None, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Prompt token ids; a session's follow-up reuses every earlier token exactly and encodes only what is new.

        The new part is found by messages (the request extends our last reply: render the conversation up to that
        reply and take what the template adds after it) or, failing that, by text (the decoded session tokens are
        a prefix of the rendered prompt). A request that fits neither rewrote the conversation: 400.
        """
        full = self._render(messages, tools, True)
        if s is None or s.record.num_turns == 0:
            return self._encode(full)
        rec = s.record
        if s.history and extends(s.history, messages):
            upto = self._render(messages[: len(s.history)], tools, False)
            eos = self.tok.eos_token or ""
            cut = upto.rfind(eos) if eos else -1
            if full.startswith(upto) and cut >= 0:
                ended = bool(rec.turns) and rec.turns[-1].token_ids[-1:] == [self.tok.eos_token_id]
                # what the template puts after the model's reply: "\n" after the engine's eos (or eos + "\n" when
                # the reply was cut at max_tokens), then the new messages and the generation prompt
                env = upto[cut + len(eos) if ended else cut:] + full[len(upto):]
                return rec.all_ids + self._encode(env)
        prev = self.tok.decode(rec.all_ids, skip_special_tokens=False)
        if full.startswith(prev):
            return rec.all_ids + self._encode(full[len(prev):])
        raise ApiError(400, "the conversation was rewritten between turns (it does not extend this session's "
                            "earlier messages and replies); only append-only conversations can be trained on",
                       "conversation_rewritten", "messages")

    # generation -------------------------------------------------------------------------------
    def _pick(self, s: _Session | None) -> int:
        if s is not None and s.engine is not None:
            return s.engine
        idx = min(range(len(self.engines)), key=lambda i: self.load[i])
        if s is not None:
            s.engine = idx
        return idx

    async def generate(self, idx: int, prompt: list[int], sampling: Sampling, rid: str, disconnected=None) -> Generation:
        """One engine call. If `disconnected()` turns true (the client left) or we are cancelled, the engine
        request is aborted, so nothing stays running for a client that is gone."""
        eng = self.engines[idx]
        self.load[idx] += 1
        ref = eng.generate.remote(prompt, sampling, rid)
        try:
            fut = asyncio.ensure_future(ref)
            deadline = time.monotonic() + self.timeout
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.5 if disconnected else self.timeout)
                if done:
                    return fut.result()
                if disconnected is not None and await disconnected():
                    raise ApiError(499, "the client disconnected", "client_disconnected")
                if time.monotonic() > deadline:
                    raise ApiError(504, f"the engine did not answer within gateway.request_timeout={self.timeout}s",
                                   "timeout")
        except (asyncio.CancelledError, ApiError):
            self.counts["aborted"] += 1
            eng.abort.remote(rid)
            ray.cancel(ref)
            raise
        finally:
            self.load[idx] -= 1

    def _limits(self, s: _Session | None, prompt: list[int], max_tokens: int | None, n: int) -> int:
        """max_tokens for this call, or an ApiError: context, trajectory budget, n."""
        limit = 1 if s is not None else self.MAX_N_UNBOUND
        if not isinstance(n, int) or n < 1 or n > limit:
            why = "a session is one trajectory; the GRPO group is made of tasks" if s is not None else "unbound requests"
            raise ApiError(400, f"n={n} is not allowed: at most {limit} ({why})", "invalid_n", "n")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "invalid_value", "max_tokens")
        room = self.max_model_len - len(prompt)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {len(prompt) + (max_tokens or 0)} tokens ({len(prompt)} in the messages, "
                                f"{max_tokens or 0} in the completion).", "context_length_exceeded", "messages")
        want = min(max_tokens or room, room)
        if s is None:
            return want
        rec = s.record
        if rec.num_turns == 0 and s.max_prompt and len(prompt) > s.max_prompt:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens, more than data.max_prompt_length={s.max_prompt}",
                           "context_length_exceeded", "messages")
        if s.budget is None:
            return want
        used = len(rec.response_ids) + (len(prompt) - len(rec.all_ids) if rec.num_turns else 0)
        left = s.budget - used
        if left <= 0:
            raise ApiError(400, f"the trajectory's token budget (rollout.max_response_length={s.budget}) is used up",
                           "budget_exceeded", "max_tokens")
        return min(want, left)

    def _sampling(self, s: _Session | None, body: dict, max_tokens: int) -> Sampling:
        d = s.sampling if s is not None else {"temperature": self.cfg.rollout.temperature, "top_p": self.cfg.rollout.top_p}
        t, p = body.get("temperature"), body.get("top_p")
        for name, v in (("temperature", t), ("top_p", p)):
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise ApiError(400, f"{name} must be a number >= 0, got {v!r}", "invalid_value", name)
        return Sampling(max_tokens=max_tokens, temperature=d["temperature"] if t is None else float(t),
                        top_p=d["top_p"] if p is None else float(p), ignore_eos=bool(body.get("ignore_eos", False)))

    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and m not in self.aliases:
            raise ApiError(404, f"The model `{m}` does not exist.", "model_not_found", "model")

    async def chat(self, body: dict, path_sid: str | None, api_key: str | None, disconnected=None) -> dict:
        """One /v1/chat/completions request -> the response body (a dict); raises ApiError."""
        self.check_model(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' is required and must be a non-empty list", "missing_messages", "messages")
        messages = normalize_messages(msgs)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", "invalid_value", "tools")
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        n = body.get("n") or 1
        s = self.bind(path_sid, api_key, messages)
        self.counts["requests"] += 1
        if s is None:
            self.counts["unbound_requests"] += 1
            return await self._chat_unbound(body, messages, tools, tool_choice, n, disconnected)
        async with s.lock:
            try:
                prompt = self.prompt_ids(s, messages, tools)
                max_tokens = self._limits(s, prompt, body.get("max_completion_tokens") or body.get("max_tokens"), n)
            except ApiError as e:
                s.record.errors.append(f"{e.status} {e.code}: {e.message}")
                raise
            idx, t0 = self._pick(s), time.time()
            gen = await self.generate(idx, prompt, self._sampling(s, body, max_tokens),
                                      f"{s.record.session_id}/{s.record.num_turns}/{uuid.uuid4().hex[:8]}", disconnected)
            turn = s.record.record(gen, idx, t0)
            self.counts["recorded_turns"] += 1
            choice, turn.parse_error = self._choice(0, gen, tools, tool_choice, body.get("logprobs"))
            if turn.parse_error is not None:
                s.record.parse_errors.append(f"turn {s.record.num_turns - 1}: {turn.parse_error}")
            turn.tool_calls = len(choice["message"].get("tool_calls") or [])
            s.history = messages + normalize_messages([choice["message"]])
            s.tools = tools
        return self._chat_response([choice], [gen], len(prompt), s.record.session_id)

    async def _chat_unbound(self, body, messages, tools, tool_choice, n, disconnected) -> dict:
        prompt = self.prompt_ids(None, messages, tools)
        max_tokens = self._limits(None, prompt, body.get("max_completion_tokens") or body.get("max_tokens"), n)
        sampling = self._sampling(None, body, max_tokens)
        gens = await asyncio.gather(*[self.generate(self._pick(None), prompt, sampling, f"unbound/{uuid.uuid4().hex}",
                                                    disconnected) for _ in range(n)])
        choices = [self._choice(i, g, tools, tool_choice, body.get("logprobs"))[0] for i, g in enumerate(gens)]
        return self._chat_response(choices, gens, len(prompt), None)

    def _choice(self, i: int, gen: Generation, tools, tool_choice, want_logprobs) -> tuple[dict, str | None]:
        """One OpenAI choice from a generation, tool calls parsed; and the parse error of a malformed tool call."""
        self.counts["tokens_out"] += len(gen.token_ids)
        text = self.tok.decode(gen.token_ids, skip_special_tokens=True)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if gen.finish_reason == "length" else "stop"
        choice: dict[str, Any] = {"index": i, "message": msg, "finish_reason": finish, "logprobs": None}
        error = None
        if tools and tool_choice != "none":
            raw = self.tok.decode(gen.token_ids, skip_special_tokens=False)  # <tool_call> may be a special token
            raw = raw.removesuffix(self.tok.eos_token or "\0")
            content, calls, error = parse_tool_calls(raw, self.tok)
            if calls:
                msg["content"], msg["tool_calls"] = content, calls
                choice["finish_reason"] = "tool_calls"
            elif error is not None:  # the text as the model wrote it, tags included
                msg["content"] = content
                self.counts["parse_errors"] += 1
        if want_logprobs:
            choice["logprobs"] = {"content": [
                {"token": self.tok.convert_ids_to_tokens(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(gen.token_ids, gen.logprobs)]}
        return choice, error

    def _chat_response(self, choices: list[dict], gens: list[Generation], prompt_len: int, sid: str | None) -> dict:
        out = sum(len(g.token_ids) for g in gens)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "system_fingerprint": sid,
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": out, "total_tokens": prompt_len + out}}

    async def completion(self, body: dict, path_sid: str | None, api_key: str | None, disconnected=None) -> dict:
        """/v1/completions: a text prompt (or token ids); bound requests must extend the session's tokens."""
        self.check_model(body)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not (isinstance(p, str) and p) and not (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            raise ApiError(400, "'prompt' is required: one string or one list of token ids", "missing_prompt", "prompt")
        n = body.get("n") or 1
        s = self.bind(path_sid, api_key, None)
        self.counts["requests"] += 1
        self.counts["unbound_requests"] += s is None

        async def run() -> tuple[list[int], list[Generation]]:
            if isinstance(p, list):
                prompt = list(p)
            elif s is not None and s.record.num_turns:
                prev = self.tok.decode(s.record.all_ids, skip_special_tokens=False)
                prompt = s.record.all_ids + self._encode(p[len(prev):]) if p.startswith(prev) else self._encode(p)
            else:
                prompt = self._encode(p)
            if any(t < 0 or t >= len(self.tok) for t in prompt):
                raise ApiError(400, "prompt token ids out of the vocabulary", "invalid_prompt", "prompt")
            max_tokens = self._limits(s, prompt, body.get("max_tokens") or 16, n)
            sampling = self._sampling(s, body, max_tokens)
            if s is None:
                return prompt, list(await asyncio.gather(*[self.generate(self._pick(None), prompt, sampling,
                                                                         f"unbound/{uuid.uuid4().hex}", disconnected)
                                                           for _ in range(n)]))
            if s.record.num_turns and prompt[: len(s.record.all_ids)] != s.record.all_ids:
                raise ApiError(400, "the prompt does not extend this session's tokens", "conversation_rewritten", "prompt")
            idx, t0 = self._pick(s), time.time()
            gen = await self.generate(idx, prompt, sampling, f"{s.record.session_id}/{s.record.num_turns}", disconnected)
            s.record.record(gen, idx, t0)
            self.counts["recorded_turns"] += 1
            return prompt, [gen]

        if s is None:
            prompt, gens = await run()
        else:
            async with s.lock:
                prompt, gens = await run()
        choices = []
        for i, g in enumerate(gens):
            self.counts["tokens_out"] += len(g.token_ids)
            choices.append({"index": i, "text": self.tok.decode(g.token_ids, skip_special_tokens=True), "logprobs": None,
                            "finish_reason": "length" if g.finish_reason == "length" else "stop"})
        out = sum(len(g.token_ids) for g in gens)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": out, "total_tokens": len(prompt) + out}}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rayrl",
                                            "root": self.model_path, "max_model_len": self.max_model_len}]}

    # HTTP -------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Listen on gateway.host:port (0 = any free port); returns the base URL (`http://host:port`)."""
        import uvicorn

        g = self.cfg.gateway
        if not g.enabled:  # no listener: clients come through request() (rollout.RayTransport)
            self.base_url = "http://rayrl-gateway"
            return self.base_url
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((g.host, g.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"the Gateway cannot listen on gateway.host={g.host!r} gateway.port={g.port}: {e} "
                               "(gateway.port=0 takes any free port)") from None
        sock.listen(2048)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        host = g.host if g.host not in ("0.0.0.0", "") else ray.util.get_node_ip_address()
        self.base_url = f"http://{host}:{port}"
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=75)
        self._server = uvicorn.Server(config)
        self._serve = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(200):  # until it accepts connections
            if self._server.started or self._serve.done():
                break
            await asyncio.sleep(0.02)
        if self._serve.done():
            self._serve.result()  # raises what stopped it
        return self.base_url

    def url(self) -> str:
        return self.base_url

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        """One HTTP request served in-process (no socket): the same app, reached through a Ray call."""
        import httpx

        if self._local is None:
            self._local = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(self)), base_url="http://gateway",
                                            timeout=self.timeout)
        r = await self._local.request(method, path, headers=headers, content=body)
        return r.status_code, [(k, v) for k, v in r.headers.items() if k.lower() != "content-encoding"], r.content

    async def shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait({self._serve}, timeout=5)
            self._server = None


def _error(e: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def build_app(gw: Gateway):
    """The Starlette app: OpenAI routes at /v1/... and /sessions/{sid}/v1/..., plus /health."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def read(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        return body

    def key_of(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    async def handle(request: Request, kind: str):
        try:
            body = await read(request)
            sid = request.path_params.get("sid")
            if body.get("stream"):
                return await stream(request, body, sid, kind)
            fn = gw.chat if kind == "chat" else gw.completion
            return JSONResponse(await fn(body, sid, key_of(request), request.is_disconnected))
        except ApiError as e:
            gw.counts["errors_4xx" if e.status < 500 else "errors_5xx"] += 1
            return _error(e)
        except Exception as e:  # an engine failure: a 500 with the reason, the server goes on
            gw.counts["errors_5xx"] += 1
            log.exception("gateway request failed")
            return _error(ApiError(500, f"{type(e).__name__}: {e}"[:1000], "engine_error"))

    async def stream(request: Request, body: dict, sid: str | None, kind: str):
        """SSE: the engine call is not streamed token by token yet, so the text comes as one chunk. A client that
        disconnects cancels this generator, and generate() aborts the engine request."""
        fn = gw.chat if kind == "chat" else gw.completion
        # Validate and bind before the 200 goes out, so bad input still gets its 4xx.
        gw.check_model(body)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def chunk(choices, usage=None) -> str:
                c = {"id": cid, "object": obj, "created": int(time.time()), "model": gw.model_name, "choices": choices}
                if usage is not None:
                    c["usage"] = usage
                return f"data: {json.dumps(c)}\n\n"

            if kind == "chat":
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            try:
                res = await fn(body, sid, key_of(request))
            except ApiError as e:
                gw.counts["errors_4xx" if e.status < 500 else "errors_5xx"] += 1
                yield f"data: {json.dumps(e.body())}\n\n"
                return
            for c in res["choices"]:
                if kind == "chat":
                    m = c["message"]
                    delta: dict[str, Any] = {"content": m.get("content")}
                    if m.get("tool_calls"):
                        delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(m["tool_calls"])]
                    yield chunk([{"index": c["index"], "delta": delta, "finish_reason": None, "logprobs": c["logprobs"]}])
                    yield chunk([{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}])
                else:
                    yield chunk([{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                                  "logprobs": None}])
            if include_usage:
                yield chunk([], res["usage"])
            yield "data: [DONE]\n\n"

        if kind == "chat":  # errors knowable up front get a real status code
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' is required and must be a non-empty list", "missing_messages", "messages")
            if sid is not None:
                gw._session(sid)
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def chat(request: Request):
        return await handle(request, "chat")

    async def completions(request: Request):
        return await handle(request, "completion")

    async def models(request: Request):
        sid = request.path_params.get("sid")
        if sid is not None:
            try:
                gw._session(sid)
            except ApiError as e:
                return _error(e)
        return JSONResponse(gw.models())

    async def health(request: Request):
        return JSONResponse({"status": "ok", **gw.stats()})

    routes = [Route("/health", health, methods=["GET"])]
    for prefix in ("", "/sessions/{sid}"):
        routes += [Route(f"{prefix}/v1/models", models, methods=["GET"]),
                   Route(f"{prefix}/v1/chat/completions", chat, methods=["POST"]),
                   Route(f"{prefix}/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes)


GatewayActor = ray.remote(Gateway)
