"""Gateway: the OpenAI chat API over HTTP in front of the Engines, recording every call token for token.

Agents (in-process functions through `ctx.llm`, or external services with their own config) talk
plain OpenAI; the Gateway renders prompts with the model's chat template, sends token ids to the
least-loaded Engine (sticky per session, so prefix caches hit), and records per session the exact
prompt ids, sampled ids, engine logprobs and the loss mask (model tokens 1, tool/user/env tokens 0).
The learner trains on that record; nothing is re-tokenized afterwards.

Which session a request belongs to and its prompt's token ids: rayrl.sessions. The OpenAI format (errors,
messages, tool calls, response bodies): rayrl.chat. Here: `Gateway`, the plain class that serves a request
from a session and an engine; `build_app`, its HTTP routes; `GatewayActor`, the Ray actor, whose event loop
also runs the uvicorn server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray

from rayrl import templates
from rayrl.chat import (
    ROLE_DELTA,
    ApiError,
    finish_reason,
    messages_of,
    normalize_messages,
    parse_tool_calls,
    prompt_of,
    response,
    stream_choices,
    stream_chunk,
    vllm_tool_parser,
)
from rayrl.config import Config
from rayrl.engine import Sampling
from rayrl.sessions import Session, Sessions
from rayrl.types import Generation, SessionRecord, Turn

log = logging.getLogger(__name__)


class Gateway:
    """Plain class (requests -> sessions, prompts, engines, records); `GatewayActor` below is the Ray actor."""

    def __init__(self, cfg: Config, model_path: str, engines: list, model_name: str | None = None):
        self.cfg, self.model_path, self.engines = cfg, model_path, engines
        # model.chat_template: the template prompts are rendered with (and tool calls parsed from), as `rayrl sft` does
        self.tok = templates.tokenizer(model_path, cfg.model.chat_template)
        g = cfg.gateway
        self.model_name = model_name or g.model_name
        self.aliases = {self.model_name, model_path, model_path.rstrip("/").split("/")[-1]}
        self.max_model_len = cfg.engine.max_model_len
        self.timeout = g.request_timeout
        r = cfg.rollout  # a dead worker's sessions expire (rollout.session_ttl)
        self.sessions = Sessions(self.tok, self.max_model_len, r.session_ttl or 2 * r.agent_timeout)
        self.load = [0] * len(engines)  # requests in flight per engine
        self.counts: dict[str, int] = {"requests": 0, "unbound_requests": 0, "recorded_turns": 0, "parse_errors": 0,
                                       "aborted": 0, "errors_4xx": 0, "errors_5xx": 0, "tokens_out": 0}
        self.base_url = ""  # set by start()
        self._server = None  # uvicorn, when listening
        self._serve: asyncio.Task | None = None  # its serve() task
        self._local = None  # in-process client of the app, for request()
        self._parser: asyncio.Future | None = None  # tool_parser()

    def tool_parser(self) -> asyncio.Future:
        """vLLM's tool parser for this tokenizer (None without vLLM), built once, in a thread: importing vLLM's parsers
        takes seconds (3.5 s on the CPU machine). Built on the event loop at the first tool call, it held every
        request in flight that long: on the GPU, all of step 1's first turns ended together, ~5 s late. start()
        begins it, so it is ready before the engines are."""
        if self._parser is None:
            self._parser = asyncio.ensure_future(asyncio.to_thread(vllm_tool_parser, self.tok))
        return self._parser

    # sessions ---------------------------------------------------------------------------------
    def open_session(self, task_id: str, budget: int | None = None, max_prompt: int | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     match: str | None = None) -> tuple[str, str, str]:
        """A new session -> (session_id, api_key, base_url of its OpenAI API: `<gateway>/sessions/<sid>/v1`)."""
        r = self.cfg.rollout
        s = self.sessions.open(task_id, budget, max_prompt, match=match,
                               sampling={"temperature": r.temperature if temperature is None else temperature,
                                         "top_p": r.top_p if top_p is None else top_p})
        sid = s.record.session_id
        return sid, s.key, f"{self.base_url}/sessions/{sid}/v1"

    def close_session(self, session_id: str) -> SessionRecord:
        """End a session; its record is what the learner trains on. Later calls to it get a 410."""
        return self.sessions.close(session_id)

    def open_sessions(self, requests: list[dict]) -> list[tuple[str, str, str] | Exception]:
        """`open_session(**r)` for each request, in one actor call (a rollout worker's episodes start together:
        rayrl.coalesce); a request that fails gets its exception in its place."""
        return [_or_error(functools.partial(self.open_session, **r)) for r in requests]

    def close_sessions(self, session_ids: list[str]) -> list[SessionRecord | Exception]:
        """`close_session` for each id, in one actor call; an id that fails gets its exception in its place."""
        return [_or_error(functools.partial(self.close_session, sid)) for sid in session_ids]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "open_sessions": len(self.sessions), "expired_sessions": self.sessions.expired,
                "inflight": list(self.load)}

    def count_error(self, e: ApiError) -> None:
        self.counts["errors_4xx" if e.status < 500 else "errors_5xx"] += 1

    # generation -------------------------------------------------------------------------------
    def _pick(self, s: Session | None) -> int:
        if s is not None and s.engine is not None:
            return s.engine
        idx = min(range(len(self.engines)), key=lambda i: self.load[i])
        if s is not None:
            s.engine = idx
        return idx

    async def generate(self, idx: int, prompt: list[int], sampling: Sampling, rid: str,
                       disconnected=None) -> Generation:
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

    async def _unbound(self, prompt: list[int], sampling: Sampling, n: int, disconnected) -> list[Generation]:
        """n samples of a request no session records, each on the least-loaded engine."""
        return list(await asyncio.gather(*[self.generate(self._pick(None), prompt, sampling,
                                                         f"unbound/{uuid.uuid4().hex}", disconnected)
                                           for _ in range(n)]))

    async def _turn(self, s: Session, prompt: list[int], sampling: Sampling,
                    disconnected) -> tuple[Generation, Turn]:
        """One recorded engine call of a session (its lock held) -> (generation, the recorded turn)."""
        idx, t0 = self._pick(s), time.time()
        gen = await self.generate(idx, prompt, sampling,
                                  f"{s.record.session_id}/{s.record.num_turns}/{uuid.uuid4().hex[:8]}", disconnected)
        turn = s.record.record(gen, idx, t0)
        self.counts["recorded_turns"] += 1
        return gen, turn

    def _sampling(self, s: Session | None, body: dict, max_tokens: int) -> Sampling:
        r = self.cfg.rollout
        d = s.sampling if s is not None else {"temperature": r.temperature, "top_p": r.top_p}
        t, p = body.get("temperature"), body.get("top_p")
        for name, v in (("temperature", t), ("top_p", p)):
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise ApiError(400, f"{name} must be a number >= 0, got {v!r}", "invalid_value", name)
        if s is not None and any(v is not None and float(v) != d[k] for k, v in (("temperature", t), ("top_p", p))):
            self._warn_override(d, t, p)
        return Sampling(max_tokens=max_tokens, temperature=d["temperature"] if t is None else float(t),
                        top_p=d["top_p"] if p is None else float(p), ignore_eos=bool(body.get("ignore_eos", False)))

    def _warn_override(self, d: dict, t, p) -> None:
        """A recorded turn sampled at another temperature / top_p than its session's: the engine's log-probs of it
        are of that distribution, the learner's of rollout.temperature / top_p, so the step trains off-distribution
        (the rollout_corr/ metrics show it as mismatch). Counted; one warning per Gateway."""
        self.counts["sampling_overrides"] = self.counts.get("sampling_overrides", 0) + 1
        if self.counts["sampling_overrides"] == 1:
            log.warning("gateway: a request set temperature=%s top_p=%s, not its session's %s / %s (rollout.temperature"
                        " / rollout.top_p): its tokens are trained with log-probs of another distribution; leave them "
                        "unset in the agent, or set them in rollout. Counted in /health sampling_overrides",
                        t, p, d["temperature"], d["top_p"])

    # OpenAI requests --------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and m not in self.aliases:
            raise ApiError(404, f"The model `{m}` does not exist.", "model_not_found", "model")

    async def chat(self, body: dict, path_sid: str | None, api_key: str | None, disconnected=None) -> dict:
        """One /v1/chat/completions request -> the response body (a dict); raises ApiError."""
        self.check_model(body)
        messages = normalize_messages(messages_of(body))
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", "invalid_value", "tools")
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        n = body.get("n") or 1
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        s = self.sessions.bind(path_sid, api_key, messages)
        self.counts["requests"] += 1
        # shielded: a request cancelled while the parser is built does not cancel it for the others
        parse = bool(tools) and tool_choice != "none"
        parser = await asyncio.shield(self.tool_parser()) if parse else None
        if s is None:
            self.counts["unbound_requests"] += 1
            prompt = self.sessions.prompt_ids(None, messages, tools)
            sampling = self._sampling(None, body, self.sessions.limits(None, prompt, max_tokens, n))
            gens = await self._unbound(prompt, sampling, n, disconnected)
            choices = [self._choice(i, g, parse, parser, body.get("logprobs"))[0] for i, g in enumerate(gens)]
            return response(True, self.model_name, choices, len(prompt), sum(len(g.token_ids) for g in gens))
        async with s.lock:
            try:
                prompt = self.sessions.prompt_ids(s, messages, tools)
                limit = self.sessions.limits(s, prompt, max_tokens, n)
            except ApiError as e:
                s.record.errors.append(f"{e.status} {e.code}: {e.message}")
                raise
            gen, turn = await self._turn(s, prompt, self._sampling(s, body, limit), disconnected)
            choice, turn.parse_error = self._choice(0, gen, parse, parser, body.get("logprobs"))
            if turn.parse_error is not None:
                s.record.parse_errors.append(f"turn {s.record.num_turns - 1}: {turn.parse_error}")
            turn.tool_calls = len(choice["message"].get("tool_calls") or [])
            s.history = messages + normalize_messages([choice["message"]])
        return response(True, self.model_name, [choice], len(prompt), len(gen.token_ids), s.record.session_id)

    def _choice(self, i: int, gen: Generation, parse: bool, parser, want_logprobs) -> tuple[dict, str | None]:
        """One OpenAI choice from a generation, tool calls parsed when `parse` (with tool_parser()'s `parser`, or the
        regex where that is None); and the parse error of a malformed tool call."""
        self.counts["tokens_out"] += len(gen.token_ids)
        text = self.tok.decode(gen.token_ids, skip_special_tokens=True)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        choice: dict[str, Any] = {"index": i, "message": msg, "finish_reason": finish_reason(gen.finish_reason),
                                  "logprobs": None}
        error = None
        if parse:
            raw = self.tok.decode(gen.token_ids, skip_special_tokens=False)  # <tool_call> may be a special token
            raw = raw.removesuffix(self.tok.eos_token or "\0")
            content, calls, error = parse_tool_calls(raw, parser)
            if calls:
                msg["content"], msg["tool_calls"] = content, calls
                choice["finish_reason"] = "tool_calls"
            elif error is not None:  # the text as the model wrote it, tags included
                msg["content"] = content
                self.counts["parse_errors"] += 1
        if want_logprobs:
            choice["logprobs"] = {"content": [
                {"token": self.tok.convert_ids_to_tokens(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(gen.token_ids, gen.logprobs, strict=False)]}
        return choice, error

    async def completion(self, body: dict, path_sid: str | None, api_key: str | None, disconnected=None) -> dict:
        """/v1/completions: a text prompt (or token ids); bound requests must extend the session's tokens."""
        self.check_model(body)
        p = prompt_of(body)
        n = body.get("n") or 1
        s = self.sessions.bind(path_sid, api_key, None)
        self.counts["requests"] += 1
        self.counts["unbound_requests"] += s is None
        if s is None:
            prompt, gens = await self._complete(None, p, body, n, disconnected)
        else:
            async with s.lock:
                prompt, gens = await self._complete(s, p, body, n, disconnected)
        choices = []
        for i, g in enumerate(gens):
            self.counts["tokens_out"] += len(g.token_ids)
            choices.append({"index": i, "text": self.tok.decode(g.token_ids, skip_special_tokens=True),
                            "logprobs": None,
                            "finish_reason": finish_reason(g.finish_reason)})
        return response(False, self.model_name, choices, len(prompt), sum(len(g.token_ids) for g in gens))

    async def _complete(self, s: Session | None, p: str | list[int], body: dict, n: int,
                        disconnected) -> tuple[list[int], list[Generation]]:
        prompt = list(p) if isinstance(p, list) else self.sessions.text_prompt_ids(s, p)
        if any(t < 0 or t >= len(self.tok) for t in prompt):
            raise ApiError(400, "prompt token ids out of the vocabulary", "invalid_prompt", "prompt")
        sampling = self._sampling(s, body, self.sessions.limits(s, prompt, body.get("max_tokens") or 16, n))
        if s is None:
            return prompt, await self._unbound(prompt, sampling, n, disconnected)
        if s.record.num_turns and prompt[: len(s.record.all_ids)] != s.record.all_ids:
            raise ApiError(400, "the prompt does not extend this session's tokens", "conversation_rewritten", "prompt")
        gen, _ = await self._turn(s, prompt, sampling, disconnected)
        return prompt, [gen]

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rayrl",
                                            "root": self.model_path, "max_model_len": self.max_model_len}]}

    # HTTP -------------------------------------------------------------------------------------
    async def start(self, port: int | None = None) -> str:
        """Listen on gateway.host:port (0 = any free port), or on `port` (a restarted Gateway: the port it had, so that
        its URL stays); returns the base URL (`http://host:port`)."""
        import uvicorn

        self.tool_parser()  # in a thread, while the engines load
        g = self.cfg.gateway
        if not g.enabled:  # no listener: clients come through request() (rollout.RayTransport)
            self.base_url = "http://rayrl-gateway"
            return self.base_url
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = g.port if port is None else port
        try:
            sock.bind((g.host, port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"the Gateway cannot listen on gateway.host={g.host!r} gateway.port={port}: {e} "
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


# --- the HTTP app: routes -> the Gateway in app.state.gateway --------------------------------------

def _or_error(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - returned to its own caller (rayrl.coalesce), not to the whole batch
        return e


def build_app(gw: Gateway):
    """The Starlette app: OpenAI routes at /v1/... and /sessions/{sid}/v1/..., plus /health."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    routes = [Route("/health", _health, methods=["GET"])]
    for prefix in ("", "/sessions/{sid}"):
        routes += [Route(f"{prefix}/v1/models", _models, methods=["GET"]),
                   Route(f"{prefix}/v1/chat/completions", _chat, methods=["POST"]),
                   Route(f"{prefix}/v1/completions", _completions, methods=["POST"])]
    app = Starlette(routes=routes)
    app.state.gateway = gw
    return app


def _json(body: dict, status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


async def _read(request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    return body


def _key(request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def _health(request):
    return _json({"status": "ok", **request.app.state.gateway.stats()})


async def _models(request):
    gw: Gateway = request.app.state.gateway
    sid = request.path_params.get("sid")
    if sid is not None:
        try:
            gw.sessions.get(sid)
        except ApiError as e:
            return _json(e.body(), e.status)
    return _json(gw.models())


async def _chat(request):
    return await _post(request, chat=True)


async def _completions(request):
    return await _post(request, chat=False)


async def _post(request, chat: bool):
    """A chat or text completion: the body, an SSE stream when asked, or the error; an engine failure is a 500."""
    gw: Gateway = request.app.state.gateway
    try:
        body = await _read(request)
        sid = request.path_params.get("sid")
        if body.get("stream"):
            return _stream(gw, body, sid, _key(request), chat)
        serve = gw.chat if chat else gw.completion
        return _json(await serve(body, sid, _key(request), request.is_disconnected))
    except ApiError as e:
        gw.count_error(e)
        return _json(e.body(), e.status)
    except Exception as e:  # an engine failure: a 500 with the reason, the server goes on
        gw.counts["errors_5xx"] += 1
        if isinstance(e, ray.exceptions.RayError):  # an engine died or is restarting: the reason is the whole story
            log.warning("gateway request failed: %s", f"{type(e).__name__}: {e}".splitlines()[0][:300])
        else:  # anything else is a bug here: its traceback
            log.exception("gateway request failed")
        return _json(ApiError(500, f"{type(e).__name__}: {e}"[:1000], "engine_error").body(), 500)


def _stream(gw: Gateway, body: dict, sid: str | None, key: str | None, chat: bool):
    """SSE. Input errors knowable up front (model; for chat, messages and session) raise here, so they still get
    their 4xx status before the 200 goes out."""
    from starlette.responses import StreamingResponse

    gw.check_model(body)
    if chat:
        messages_of(body)
        if sid is not None:
            gw.sessions.get(sid)
    return StreamingResponse(_events(gw, body, sid, key, chat), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(gw: Gateway, body: dict, sid: str | None, key: str | None, chat: bool) -> AsyncIterator[str]:
    """The engine call is not streamed token by token yet, so the text comes as one chunk. A client that
    disconnects cancels this generator, and generate() aborts the engine request."""
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def sse(choices: list[dict], usage: dict | None = None) -> str:
        return f"data: {json.dumps(stream_chunk(chat, cid, gw.model_name, choices, usage))}\n\n"

    if chat:
        yield sse(ROLE_DELTA)
    try:
        res = await (gw.chat if chat else gw.completion)(body, sid, key)
    except ApiError as e:
        gw.count_error(e)
        yield f"data: {json.dumps(e.body())}\n\n"
        return
    for choices in stream_choices(res, chat):
        yield sse(choices)
    if include_usage:
        yield sse([], res["usage"])
    yield "data: [DONE]\n\n"

