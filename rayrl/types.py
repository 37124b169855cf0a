"""Typed records that travel between actors (no string-keyed dicts)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Task:
    """One agent episode to run: a prompt and everything needed to score it.

    A prompt with `rollout.n` samples yields n Tasks sharing `group_id` (the GRPO group).
    """

    task_id: str  # unique in the run: f"{group_id}/{sample}"
    group_id: str  # f"s{step}/p{index}": one prompt of one step
    step: int  # the training step this task belongs to
    messages: list[dict[str, Any]]  # OpenAI chat messages
    ground_truth: Any
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0  # the policy version at dispatch
    sampling: dict[str, float] = field(default_factory=dict)  # session defaults (temperature, top_p) over rollout's


@dataclass
class Trajectory:
    """What one episode produced, exactly as the engine produced it.

    `response_ids` holds every token after the prompt: model tokens (loss_mask 1) and
    tool/env tokens inserted between turns (loss_mask 0). `logprobs` are the engine's
    logprobs of the sampled tokens (0.0 where loss_mask is 0).
    """

    task_id: str
    group_id: str
    step: int
    data_source: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float | None = None
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0  # version of the weights that generated the first token
    versions: list[int] = field(default_factory=list)  # each response token's policy version, -1 where loss_mask is 0
    finish_reason: str = ""
    num_turns: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the agent or the reward failed; the trajectory is then not trained on
    worker: str = ""
    # Spans inside the episode, for the trace (rayrl.trace): {"name": "llm" | "tool:<name>" | "sandbox" | "reward",
    # "start": time.time(), "end": time.time(), "cat": optional str,
    # "args": {e.g. "prompt_tokens", "completion_tokens"}}.
    # Wall-clock times; optional: without them the trace shows the episode as agent + reward from `timings`.
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.reward is not None and len(self.response_ids) > 0


@dataclass
class Generation:
    """One engine call's result."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int  # of the first token
    versions: list[int] = field(default_factory=list)  # each token's policy version (a partial rollout spans several)


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
    """What the Gateway's `close_session` returns: one episode's calls as one token sequence, ready for a Trajectory."""

    session_id: str
    task_id: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)  # model tokens and env tokens between turns
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the engine, 0 = env/tool/template tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 where loss_mask is 0
    versions: list[int] = field(default_factory=list)  # policy version of each sampled token, -1 where loss_mask is 0
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
            self.versions += [-1] * len(env)
        self.response_ids += gen.token_ids
        self.loss_mask += [1] * len(gen.token_ids)
        self.logprobs += gen.logprobs
        self.versions += gen.versions or [gen.policy_version] * len(gen.token_ids)
        self.num_turns += 1
        self.finish_reason = gen.finish_reason
        turn = Turn(env_len=len(env), token_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
                    finish_reason=gen.finish_reason, engine=engine, start=start, end=time.time())
        self.turns.append(turn)
        return turn


@dataclass
class StepStats:
    """One learner update, as reported back to the driver."""

    # loss, pg_clipfrac, ppo_kl, entropy: this rank's shares of the mini-batch values (the driver sums over ranks)
    loss: float
    pg_clipfrac: float
    ppo_kl: float
    grad_norm: float
    entropy: float  # of the temperature-scaled policy at each response token, token-mean over the loss mask
    num_tokens: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    # the policy's log-probs of each response token before the step (train_step without old log-probs: old =
    # current), for the driver's engine-vs-learner mismatch metrics; None when the driver passed the old log-probs in
    logprobs: list[list[float]] | None = None
    # Learner-side spans for the trace (rayrl.trace): {"name": "forward" | "backward" (per micro-batch) |
    # "optimizer_step" | "train_step" (the whole call), "start", "end": time.time(), "rank", "args"}
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainBatch:
    """One learner rank's share of a mini-batch: unpadded sequences and their per-token training data."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_mask: list[list[int]]  # per response token: 1 = model token (trained), 0 = tool/env token or failure
    advantages: list[list[float]]  # per response token
    global_tokens: int  # response tokens (mask 1) in the whole mini-batch over all ranks: token-mean divides by this
    global_seqs: int  # sequences in the whole mini-batch over all ranks
    # per response token: the engine's log-prob of it (the behaviour policy; 0.0 where loss_mask is 0)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    # per response token: the truncated importance weight on its loss (algo.rollout_correction.rollout_is); None = 1
    is_weights: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)
