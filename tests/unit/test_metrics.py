"""Validation's tool metrics: the ReTool agent's real episodes (fake LLM, real local sandbox) -> val_metrics."""

from __future__ import annotations

import asyncio

from rayrl.agents.tool_agent import agent
from rayrl.config import SandboxConfig
from rayrl.metrics import StepLogger, val_metrics
from rayrl.sandbox import SandboxPool
from rayrl.types import Trajectory
from tests.helpers import FakeLLM, completion, make_ctx


def episodes(scripts: list[list]) -> list[dict]:
    """Each script's replies through the tool agent; returns each episode's metadata."""

    async def go():
        pool = SandboxPool(SandboxConfig(timeout=10))
        try:
            return [(await agent(make_ctx(FakeLLM(replies), pool), {}))["metadata"] for replies in scripts]
        finally:
            await pool.close()

    return asyncio.run(go())


def call(code: str):
    return completion("Let me compute.", [("code_interpreter", {"code": code})])


def test_validation_reports_tool_use_per_source():
    """Per data source, as training steps report them: the share of episodes that called the tool, calls per
    episode, and the share of calls that ran cleanly (a call whose code raises is no success)."""
    metas = episodes([
        [call("print(6 * 7)"), completion("\\boxed{42}")],  # one clean call
        [call("1/0"), call("print(1 + 1)"), completion("\\boxed{2}")],  # a failing call, then a clean one
        [completion("\\boxed{3}")],  # no call
        [call("print(2 ** 5)"), completion("\\boxed{32}")],  # the other source: one clean call
    ])
    trajs = []
    for i, (meta, source) in enumerate(zip(metas, ["aime_2024"] * 3 + ["aime_2025"], strict=True)):
        trajs.append(Trajectory(task_id=f"p{i}/0", group_id=f"p{i}", step=-1, data_source=source, prompt_ids=[1],
                                response_ids=[2, 3], loss_mask=[1, 1], reward=1.0, answer="\\boxed{1}",
                                metadata=meta))
    # a source whose agent uses no tools gets no tool metrics
    trajs.append(Trajectory(task_id="q/0", group_id="q", step=-1, data_source="gsm8k", prompt_ids=[1],
                            response_ids=[2], loss_mask=[1], reward=1.0, answer="1"))
    m = val_metrics(trajs)
    assert m["val-aux/aime_2024/tools/call_rate"] == 2 / 3
    assert m["val-aux/aime_2024/tools/calls_mean"] == 1.0
    assert m["val-aux/aime_2024/tools/success_rate"] == 2 / 3
    assert m["val-aux/aime_2025/tools/call_rate"] == 1.0 and m["val-aux/aime_2025/tools/success_rate"] == 1.0
    assert not [k for k in m if k.startswith("val-aux/gsm8k/tools/")]
    assert m["val-core/aime_2024/acc/mean@1"] == 1.0  # the accuracy metrics are still there


def test_console_line_shows_validation_tool_use(tmp_path, capsys):
    log = StepLogger(str(tmp_path), ["console"], total_steps=2, start_step=0, run_config={}, name="t")
    log.log(1, {"val-core/aime_2024/acc/mean@4": 0.25, "val-aux/aime_2024/tools/call_rate": 0.5,
                "val-aux/aime_2024/tools/calls_mean": 0.75})
    log.close()
    assert "val aime_2024 acc@4 0.250  val aime_2024 tool use 50%" in capsys.readouterr().out
