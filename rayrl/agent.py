"""The agent contract: `async def agent(ctx: TaskContext, config: dict) -> dict`, loaded from "module:function".

No subclassing. The agent sees the task and an OpenAI-style chat client bound to its session; every
call it makes is recorded token for token (prompt ids, sampled ids, engine logprobs, loss mask), so the
learner trains on exactly what the engine produced. It returns
`{"reward": float | None, "answer": Any, "metadata": dict}`; reward None means "score `answer` with
the RewardActor".
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rayrl.types import Generation, Task

AgentFn = Callable[["TaskContext", dict], Awaitable[dict]]


class Session:
    """One episode's calls as one token sequence: the first prompt, then model and env tokens in turn."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.num_turns = 0
        self.policy_version: int | None = None
        self.finish_reason = ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def record(self, gen: Generation) -> None:
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


class _Completions:
    def __init__(self, client: "ChatClient"):
        self._client = client

    async def create(self, messages: list[dict], max_tokens: int | None = None, max_completion_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, tools: list[dict] | None = None,
                     model: str | None = None, n: int = 1, **unused: Any):
        return await self._client.complete(messages, max_tokens=max_completion_tokens or max_tokens,
                                           temperature=temperature, top_p=top_p, tools=tools, n=n)


class _Chat:
    def __init__(self, client: "ChatClient"):
        self.completions = _Completions(client)


class ChatClient:
    """`ctx.llm`: the subset of `openai.AsyncOpenAI` agents use (`chat.completions.create`), served by an Engine.

    Prompts are built by the model's chat template; a follow-up turn reuses the exact token ids of the
    previous turns and tokenizes only the new messages, so nothing is re-tokenized.
    """

    def __init__(self, generate: Callable[[list[int], Any], Awaitable[Generation]], tokenizer, session: Session,
                 defaults: dict[str, Any], budget: int, max_prompt: int | None = None, model_name: str = "policy"):
        self._generate, self.tok, self.session = generate, tokenizer, session
        self.defaults, self.budget, self.max_prompt, self.model_name = defaults, budget, max_prompt, model_name
        self.chat = _Chat(self)

    def _prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        full = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        if self.session.num_turns:
            prev = self.tok.decode(self.session.all_ids, skip_special_tokens=False)
            if full.startswith(prev):
                return self.session.all_ids + self.tok.encode(full[len(prev):], add_special_tokens=False)
        return self.tok.encode(full, add_special_tokens=False)

    async def complete(self, messages, max_tokens=None, temperature=None, top_p=None, tools=None, n=1):
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import Choice
        from openai.types.completion_usage import CompletionUsage

        from rayrl.actors.engine import Sampling

        if n != 1:
            raise ValueError(f"n={n}: one session samples one completion per call (the group is made of tasks)")
        prompt = self._prompt_ids(messages, tools)
        if self.session.num_turns == 0 and self.max_prompt and len(prompt) > self.max_prompt:
            raise ValueError(f"the prompt is {len(prompt)} tokens, more than data.max_prompt_length={self.max_prompt}")
        used = len(self.session.response_ids) + (len(prompt) - len(self.session.all_ids) if self.session.num_turns else 0)
        left = self.budget - used
        if left <= 0:
            raise BudgetExceeded(f"the trajectory's token budget ({self.budget}) is used up")
        s = Sampling(max_tokens=min(max_tokens or left, left),
                     temperature=self.defaults["temperature"] if temperature is None else temperature,
                     top_p=self.defaults["top_p"] if top_p is None else top_p)
        gen = await self._generate(prompt, s)
        self.session.record(gen)
        text = self.tok.decode(gen.token_ids, skip_special_tokens=True)
        finish = "length" if gen.finish_reason == "length" else "stop"
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex[:16]}", object="chat.completion", created=int(time.time()), model=self.model_name,
            choices=[Choice(index=0, finish_reason=finish, message=ChatCompletionMessage(role="assistant", content=text))],
            usage=CompletionUsage(prompt_tokens=len(prompt), completion_tokens=len(gen.token_ids),
                                  total_tokens=len(prompt) + len(gen.token_ids)))


class BudgetExceeded(RuntimeError):
    """The episode asked for more tokens than rollout.max_response_length allows."""


@dataclass
class TaskContext:
    """What an agent gets: the task, a chat client bound to its session, and the run config."""

    task: Task
    llm: ChatClient
    run_config: Any = None  # rayrl.config.Config
    sandbox: Any = None  # code execution (the ReTool issue)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict]:
        return [dict(m) for m in self.task.messages]

    @property
    def ground_truth(self) -> Any:
        return self.task.ground_truth
