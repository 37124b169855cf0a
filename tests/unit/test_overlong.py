"""Over-long episodes (issue 15): an episode whose token budget runs out is trained truncated at
rollout.max_response_length, as verl does, not dropped as a failure; DAPO's overlong penalty is an option.

The Rollout runs its real path in-process: the Gateway (gateway.enabled=false, so requests go through its in-process
app), a tiny-model `hf` Engine and the RewardActor's plain class, each reached the way the Rollout reaches actors
(`handle.method.remote(...)`)."""

from __future__ import annotations

import asyncio
import inspect
import types

import pytest

from rayrl.config import EngineConfig, load_config
from rayrl.engine import Engine
from rayrl.gateway import Gateway
from rayrl.rollout import Rollout, overlong_penalty
from rayrl.scoring import Reward
from rayrl.sessions import ran_out
from rayrl.types import Generation, SessionRecord, Task
from tests.helpers import tiny_overrides


async def fills_the_budget_then_asks_again(ctx, config: dict) -> dict:
    """Samples until the budget is used up (eos ignored), then asks for more: the Gateway refuses, the agent raises."""
    messages = ctx.messages
    reply = await ctx.llm.chat.completions.create(messages=messages, extra_body={"ignore_eos": True})
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Go on."}]
    reply = await ctx.llm.chat.completions.create(messages=messages)
    return {"reward": None, "answer": reply.choices[0].message.content, "metadata": {}}


async def raises_after_a_call(ctx, config: dict) -> dict:
    await ctx.llm.chat.completions.create(messages=ctx.messages, max_tokens=4)
    raise RuntimeError("tool crashed")


class Local:
    """A plain object reached as a Ray actor handle is (`handle.method.remote(...)` -> an awaitable), in-process."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name: str):
        fn = getattr(self.obj, name)

        async def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        return types.SimpleNamespace(remote=call)


def _run(tiny_model, tmp_path, agent: str, **extra):
    cfg = load_config(None, tiny_overrides(tiny_model, str(tmp_path), **{
        "rollout.agent": f"tests.unit.test_overlong:{agent}", "gateway.enabled": "false",
        "reward.fn": "tests.helpers:exact", "rollout.max_response_length": 24, **extra}))
    task = Task(task_id="s0/p0/0", group_id="s0/p0", step=0, messages=[{"role": "user", "content": "What is 2+2?"}],
                ground_truth="42", data_source="test")

    async def go():
        engine = Engine(tiny_model, EngineConfig(backend="hf"))
        await engine.start()
        reward = Reward(cfg.reward.fn, cfg.reward.timeout, 1)
        gateway = Gateway(cfg, tiny_model, [Local(engine)])
        await gateway.start()  # gateway.enabled=false: no listener, requests reach it in-process
        try:
            return await Rollout("test/0", cfg, None, Local(gateway), Local(reward)).run_task(task)
        finally:
            reward.close()
            await engine.shutdown()

    return asyncio.run(go())


def test_an_episode_whose_budget_runs_out_is_trained_truncated(tiny_model, tmp_path):
    t = _run(tiny_model, tmp_path, "fills_the_budget_then_asks_again")
    # today's code made this a failed trajectory (the agent raised on the refused call) and dropped it
    assert t.ok and t.error is None and "token budget" in t.metadata["truncated"]
    assert len(t.response_ids) == 24 and sum(t.loss_mask) == 24 and t.num_turns == 1
    assert t.reward == 0.0 and "overlong_penalty" not in t.metadata  # scored as no answer ("" != "42"); no penalty


def test_dapo_overlong_penalty_is_an_option(tiny_model, tmp_path):
    t = _run(tiny_model, tmp_path, "fills_the_budget_then_asks_again",
             **{"reward.overlong_buffer_len": 8, "reward.overlong_penalty_factor": 0.5})
    assert t.ok and t.metadata["overlong_penalty"] == -0.5 and t.reward == -0.5  # 24 tokens: the whole factor


def test_other_agent_errors_stay_failures(tiny_model, tmp_path):
    t = _run(tiny_model, tmp_path, "raises_after_a_call")
    assert not t.ok and t.error == "RuntimeError: tool crashed" and "truncated" not in t.metadata


def test_ran_out_reads_the_last_refusal():
    rec = SessionRecord("s", "t")
    rec.errors.append("400 budget_exceeded: the trajectory's token budget is used up")
    assert not ran_out(rec)  # no turn recorded: a prompt that never ran is not a truncated response
    rec.record(Generation([1, 2], [3, 4], [-0.1, -0.2], "length", 0))
    assert ran_out(rec)
    rec.errors.append("400 context_length_exceeded: This model's maximum context length is 64 tokens")
    assert ran_out(rec)
    rec.errors.append("400 conversation_rewritten: the conversation was rewritten")
    assert not ran_out(rec)


@pytest.mark.parametrize("length, want", [(10, 0.0), (16, 0.0), (20, -0.5), (24, -1.0)])
def test_overlong_penalty_is_verls_linear_buffer(length, want):
    """verl's DAPORewardManager: expected = max_resp_len - buffer; min(-(length - expected) / buffer * factor, 0)."""
    assert overlong_penalty(length, 24, 8, 1.0) == pytest.approx(want)
    assert overlong_penalty(length, 24, 8, 0.5) == pytest.approx(want / 2)


def test_overlong_config_is_checked():
    from rayrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"reward.overlong_buffer_len \(24\) must be >= 0 and < "
                                          r"rollout.max_response_length \(24\)"):
        load_config(None, ["rollout.max_response_length=24", "reward.overlong_buffer_len=24"])
    with pytest.raises(ConfigError, match="reward.overlong_penalty_factor must be >= 0"):
        load_config(None, ["reward.overlong_buffer_len=8", "reward.overlong_penalty_factor=-1"])
