"""The agent contract: `async def agent(ctx: TaskContext, config: dict) -> dict`, loaded from "module:function".

No subclassing. The agent sees the task and `ctx.llm`, a real `openai.AsyncOpenAI` client bound to its
Gateway session; every call it makes is recorded by the Gateway token for token (prompt ids, sampled ids,
engine logprobs, loss mask), so the learner trains on exactly what the engine produced. It returns
`{"reward": float | None, "answer": Any, "metadata": dict}`; reward None means "score `answer` with
the RewardActor".
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rayrl.types import Task

AgentFn = Callable[["TaskContext", dict], Awaitable[dict]]


def session_client(base_url: str, api_key: str, model: str, timeout: float, http_client=None):
    """`ctx.llm`: a real `openai.AsyncOpenAI` bound to one Gateway session (its base URL and key).

    Two departures from a plain client: `model` may be left out of `chat.completions.create` (it defaults to the
    served policy, so agents written against the old in-process client keep working), and there are no retries
    (a retried call would be recorded twice). The HTTP connection pool belongs to the rollout worker, so `close()`
    leaves it open.
    """
    return _client_class()(base_url=base_url, api_key=api_key, default_model=model, timeout=timeout, max_retries=0,
                           http_client=http_client)


@functools.cache
def _client_class():
    import openai
    from openai._compat import cached_property
    from openai.resources.chat import AsyncChat
    from openai.resources.chat.completions import AsyncCompletions

    class Completions(AsyncCompletions):
        async def create(self, *, model: str | None = None, **kw: Any):  # type: ignore[override]
            return await super().create(model=model or self._client.default_model, **kw)

    class Chat(AsyncChat):
        @cached_property
        def completions(self) -> Completions:
            return Completions(self._client)

    class SessionLLM(openai.AsyncOpenAI):
        def __init__(self, *, default_model: str, **kw: Any):
            super().__init__(**kw)
            self.default_model = default_model

        @cached_property
        def chat(self) -> Chat:  # type: ignore[override]
            return Chat(self)

        async def close(self) -> None:
            pass  # the worker's shared connection pool outlives the episode

    return SessionLLM


@dataclass
class TaskContext:
    """What an agent gets: the task, a chat client bound to its session, and the run config."""

    task: Task
    llm: Any  # openai.AsyncOpenAI bound to this episode's Gateway session
    run_config: Any = None  # rayrl.config.Config
    session_id: str = ""
    base_url: str = ""  # the session's OpenAI base URL (`<gateway>/sessions/<id>/v1`), for agents that call services
    api_key: str = ""  # the session's key: binds requests to the fixed `<gateway>/v1` URL too
    sandbox: Any = None  # code execution (the ReTool issue)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict]:
        return [dict(m) for m in self.task.messages]

    @property
    def ground_truth(self) -> Any:
        return self.task.ground_truth

    @property
    def model(self) -> str:
        return self.llm.default_model
