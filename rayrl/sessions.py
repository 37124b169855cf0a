"""Sessions: which episode a Gateway request belongs to, and its prompt as token ids that extend the episode's tokens.

A request is bound to a session by, in order: the URL path (`/sessions/{sid}/v1/...`), the API key
(`Authorization: Bearer <session key>`), or its conversation prefix (for services whose base URL and
key are fixed in their own config). An unbound request is served but not recorded.

A follow-up prompt reuses every token of the session so far exactly (the engine's sampled ids, which need not be
what the tokenizer makes of their text) and encodes only what the chat template adds after them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rayrl.chat import ApiError, extends
from rayrl.types import SessionRecord


@dataclass
class Session:
    """One open episode: its record and what binding, limits and sampling need."""

    record: SessionRecord
    key: str
    budget: int | None  # response tokens (model + env) the whole episode may use
    max_prompt: int | None  # first prompt's limit
    sampling: dict[str, float]  # defaults: temperature, top_p
    match: str | None  # text the first request must contain, for prefix binding (external services)
    engine: int | None = None  # sticky engine index, chosen at the first call
    history: list[dict] | None = None  # the last request's messages + the assistant reply we returned
    opened: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time: the record is one sequence


class Sessions:
    """The open sessions of one Gateway, and the tokenizer their prompts are built with."""

    MAX_N_UNBOUND = 8  # n > 1 only for unbound requests: a session is one trajectory

    def __init__(self, tokenizer: Any, max_model_len: int, ttl: float | None = None, first_prompts: int = 1024):
        self.tok = tokenizer
        # The ids of the last `first_prompts` first-turn prompts, by text: the rollout.n samples of a task open n
        # sessions whose first prompts are the same text, and encoding was 16-22% of the Gateway's CPU on a GPU host
        self.first_prompts = first_prompts
        self._first: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.max_model_len = max_model_len
        self.ttl = ttl  # seconds a session may stay open (its episode is over by then: its worker died); None = ever
        self.expired = 0  # sessions closed by the TTL
        self.by_id: dict[str, Session] = {}
        self.keys: dict[str, str] = {}  # api key -> session id
        self.closed: OrderedDict[str, float] = OrderedDict()  # recently closed ids, for a 410 instead of a 404

    def __len__(self) -> int:
        return len(self.by_id)

    # open, close, bind ------------------------------------------------------------------------
    def open(self, task_id: str, budget: int | None, max_prompt: int | None, sampling: dict[str, float],
             match: str | None) -> Session:
        self.expire()
        sid = f"s-{uuid.uuid4().hex}"
        key = f"rk-{secrets.token_urlsafe(24)}"
        self.by_id[sid] = Session(record=SessionRecord(session_id=sid, task_id=task_id), key=key, budget=budget,
                                  max_prompt=max_prompt, sampling=sampling, match=match)
        self.keys[key] = sid
        return self.by_id[sid]

    def close(self, session_id: str) -> SessionRecord:
        """End a session and return its record. Later calls to it get a 410."""
        s = self.by_id.pop(session_id, None)
        if s is None:
            raise KeyError(f"no open session {session_id!r}")
        self.keys.pop(s.key, None)
        self.closed[session_id] = time.monotonic()
        while len(self.closed) > 100_000:
            self.closed.popitem(last=False)
        return s.record

    def expire(self) -> list[str]:
        """Close the sessions open for longer than the TTL (a worker that died never closes its own); their ids."""
        if self.ttl is None:
            return []
        now, old = time.monotonic(), []
        for sid, s in self.by_id.items():  # opening order: the oldest first
            if now - s.opened <= self.ttl:
                break
            old.append(sid)
        for sid in old:
            self.close(sid)
        self.expired += len(old)
        return old

    def get(self, sid: str) -> Session:
        """The open session `sid`; a 410 when it was closed, a 404 when it never was."""
        if sid in self.by_id:
            return self.by_id[sid]
        if sid in self.closed:
            raise ApiError(410, f"session {sid} is closed", "session_closed")
        raise ApiError(404, f"session {sid} does not exist", "session_not_found")

    def bind(self, path_sid: str | None, api_key: str | None, messages: list[dict] | None) -> Session | None:
        """The session a request belongs to: by URL path, then API key, then conversation prefix; else None."""
        if path_sid is not None:
            return self.get(path_sid)
        if api_key and api_key in self.keys:
            return self.by_id[self.keys[api_key]]
        if not messages:
            return None
        # A continuing conversation: the longest history it extends (assistant replies must match too).
        best = None
        for s in self.by_id.values():
            if (s.history and extends(s.history, messages, loose_assistant=False) and not s.lock.locked()
                    and (best is None or len(s.history) > len(best.history))):
                best = s
        if best is not None:
            return best
        # A new one: the oldest fresh session whose task text the conversation contains.
        texts = [m["content"] for m in messages if m.get("role") in ("user", "system")]
        for s in self.by_id.values():  # insertion order = opening order
            if s.match and s.record.num_turns == 0 and not s.lock.locked() and any(s.match in t for t in texts):
                return s
        return None

    # prompts ----------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None, gen_prompt: bool) -> str:
        """The chat template's text for `messages`; a 400 when it cannot render them."""
        try:
            return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=gen_prompt,
                                                tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja errors on odd messages are the client's
            raise ApiError(400, f"the chat template cannot render these messages: {e}", "invalid_messages",
                           "messages") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_first(self, text: str) -> list[int]:
        """`encode(text)` for a first-turn prompt, from the cache when the same text came recently."""
        ids = self._first.get(text)
        if ids is None:
            ids = tuple(self.encode(text))
            self._first[text] = ids
            if len(self._first) > self.first_prompts:
                self._first.popitem(last=False)
        else:
            self._first.move_to_end(text)
        return list(ids)

    def prompt_ids(self, s: Session | None, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A chat prompt's token ids; a session's follow-up reuses every earlier token exactly and encodes only what
        is new.

        The new part is found by messages (the request extends our last reply: render the conversation up to that
        reply and take what the template adds after it) or, failing that, by text (the decoded session tokens are
        a prefix of the rendered prompt). A request that fits neither rewrote the conversation: 400.
        """
        full = self.render(messages, tools, True)
        if s is None or s.record.num_turns == 0:
            return self.encode_first(full)
        rec = s.record
        if s.history and extends(s.history, messages):
            upto = self.render(messages[: len(s.history)], tools, False)
            eos = self.tok.eos_token or ""
            cut = upto.rfind(eos) if eos else -1
            if full.startswith(upto) and cut >= 0:
                ended = bool(rec.turns) and rec.turns[-1].token_ids[-1:] == [self.tok.eos_token_id]
                # what the template puts after the model's reply: "\n" after the engine's eos (or eos + "\n" when
                # the reply was cut at max_tokens), then the new messages and the generation prompt
                env = upto[cut + len(eos) if ended else cut:] + full[len(upto):]
                return rec.all_ids + self.encode(env)
        prev = self.tok.decode(rec.all_ids, skip_special_tokens=False)
        if full.startswith(prev):
            return rec.all_ids + self.encode(full[len(prev):])
        raise ApiError(400, "the conversation was rewritten between turns (it does not extend this session's "
                            "earlier messages and replies); only append-only conversations can be trained on",
                       "conversation_rewritten", "messages")

    def text_prompt_ids(self, s: Session | None, text: str) -> list[int]:
        """A text prompt's token ids; one that starts with the session's decoded tokens reuses them exactly."""
        if s is not None and s.record.num_turns:
            ids = s.record.all_ids
            prev = self.tok.decode(ids, skip_special_tokens=False)
            if text.startswith(prev):
                return ids + self.encode(text[len(prev):])
        return self.encode(text)

    # limits -----------------------------------------------------------------------------------
    def limits(self, s: Session | None, prompt: list[int], max_tokens: int | None, n: int) -> int:
        """max_tokens for this call, or an ApiError: context, trajectory budget, n."""
        limit = 1 if s is not None else self.MAX_N_UNBOUND
        if not isinstance(n, int) or n < 1 or n > limit:
            why = ("a session is one trajectory; the GRPO group is made of tasks" if s is not None
                   else "unbound requests")
            raise ApiError(400, f"n={n} is not allowed: at most {limit} ({why})", "invalid_n", "n")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "invalid_value",
                           "max_tokens")
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


# The refusals that end an episode for its length: the Gateway records each as "400 <code>: <message>".
OUT_OF_ROOM = tuple(f"400 {code}:" for code in ("budget_exceeded", "context_length_exceeded"))


def ran_out(rec: SessionRecord) -> bool:
    """Whether the episode's last request was refused because its token budget (rollout.max_response_length) or the
    context was used up, after at least one recorded turn: an over-long episode, which verl trains truncated at
    max_response_length rather than dropping it."""
    return rec.num_turns > 0 and bool(rec.errors) and rec.errors[-1].startswith(OUT_OF_ROOM)
