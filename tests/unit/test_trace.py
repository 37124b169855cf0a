"""trace.json: valid Chrome trace-event format, and spans nest as the run did (tool call in trajectory in step)."""

from __future__ import annotations

import json
import time

import pytest

from rayrl import trace
from rayrl.cli import main as cli
from rayrl.types import Trajectory
from tests.helpers import check_trace_format


def inside(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def _traj(task_id: str, start: float, total: float, events=()) -> Trajectory:
    return Trajectory(task_id=task_id, group_id=task_id.rsplit("/", 1)[0], step=0, data_source="t", prompt_ids=[1, 2],
                      response_ids=[3, 4, 5], loss_mask=[1, 0, 1], reward=1.0, num_turns=2, events=list(events),
                      timings={"agent": total * 0.8, "reward": total * 0.1, "total": total})


def _learner_events(t0: float, rank: int) -> list[dict]:
    """What a learner rank's StepStats.events hold: two micro-batches, the optimizer step, the whole call."""
    spans = [("forward", 1, 2, {"micro_batch": 0}), ("backward", 2, 4, {"micro_batch": 0}),
             ("forward", 4, 5, {"micro_batch": 1}), ("backward", 5, 7, {"micro_batch": 1}),
             ("optimizer_step", 7, 8, {}), ("train_step", 0.5, 8, {})]  # milliseconds after t0
    return [{"name": n, "start": t0 + a / 1e3, "end": t0 + b / 1e3, "rank": rank, "args": args}
            for n, a, b, args in spans]


def _run(tmp_path, steps: int = 2) -> str:
    out = str(tmp_path / "run")
    trace.start(out)
    with trace.span("start actors"):
        time.sleep(0.01)
    for s in range(1, steps + 1):
        with trace.step(s):
            with trace.span("rollout"):
                t0 = time.time()
                time.sleep(0.05)
                a = _traj(f"s{s}/p0/0", t0, 0.04, [
                    {"name": "llm", "start": t0 + 0.001, "end": t0 + 0.01,
                     "args": {"prompt_tokens": 12, "completion_tokens": 7}},
                    {"name": "tool:code_interpreter", "start": t0 + 0.011, "end": t0 + 0.03, "cat": "tool"},
                    {"name": "sandbox", "start": t0 + 0.012, "end": t0 + 0.029, "cat": "tool"},
                    {"name": "llm", "start": t0 + 0.031, "end": t0 + 0.04,
                     "args": {"prompt_tokens": 30, "completion_tokens": 5}}])
                b = _traj(f"s{s}/p0/1", t0, 0.03)  # no events: agent + reward from its timings, ending on receipt
                trace.received([b])
            trace.trajectories([a, b])
            with trace.span("learner/train_step", epoch=0, minibatch=0):
                t0 = time.time()
                time.sleep(0.01)
                trace.learner([e for r in (0, 1) for e in _learner_events(t0, r)], t0, time.time())
            with trace.span("weight_sync", version=s):
                time.sleep(0.01)
    path = trace.close()
    assert path == f"{out}/trace.json"
    return out


def test_trace_file_is_valid_and_nested(tmp_path):
    _run(tmp_path)
    doc = json.loads((tmp_path / "run" / "trace.json").read_text())
    xs = check_trace_format(doc)
    names = {e["name"] for e in xs}
    assert {"step 1", "step 2", "rollout", "learner/train_step", "weight_sync", "start actors", "llm",
            "tool:code_interpreter", "sandbox", "agent", "reward"} <= names
    for s in (1, 2):
        step = next(e for e in xs if e["name"] == f"step {s}")
        assert step["pid"] == s
        traj = next(e for e in xs if e["name"] == f"trajectory s{s}/p0/0")
        tool = next(e for e in xs if e["name"] == "tool:code_interpreter" and e["pid"] == s)
        sandbox = next(e for e in xs if e["name"] == "sandbox" and e["pid"] == s)
        assert (tool["pid"], tool["tid"]) == (traj["pid"], traj["tid"]) and inside(tool, traj)
        assert inside(sandbox, tool)
        assert traj["pid"] == step["pid"] and inside(traj, step)
        for phase in ("rollout", "learner/train_step", "weight_sync"):
            e = next(e for e in xs if e["name"] == phase and e["pid"] == s)
            assert e["tid"] == trace.DRIVER_TID and inside(e, step)
        llm = [e for e in xs if e["name"] == "llm" and e["pid"] == s]
        assert [e["args"]["completion_tokens"] for e in llm] == [7, 5]
        assert traj["args"]["response_tokens"] == 3 and traj["args"]["reward"] == 1.0
        # the learner's forward / backward / optimizer step: one lane per rank, inside the driver's train_step
        driver_step = next(e for e in xs if e["name"] == "learner/train_step" and e["pid"] == s)
        for rank in (0, 1):
            lane = [e for e in xs if e["pid"] == s and e["tid"] == trace.LEARNER_TID + rank]
            outer = next(e for e in lane if e["name"] == "train_step")
            assert [e["name"] for e in sorted(lane, key=lambda e: (e["ts"], -e["dur"]))] == [
                "train_step", "forward", "backward", "forward", "backward", "optimizer_step"]
            assert all(inside(e, outer) for e in lane) and inside(outer, driver_step) and inside(driver_step, step)
            assert all(e["args"]["rank"] == rank and e["cat"] == "learner" for e in lane)
    # overlapping trajectories get their own lanes
    t1 = [e for e in xs if e["name"].startswith("trajectory") and e["pid"] == 1]
    assert len({e["tid"] for e in t1}) == 2
    meta = {(e["pid"], e["name"]): e["args"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert meta[(1, "process_name")] == {"name": "step 1"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert lanes[(1, trace.LEARNER_TID + 1)] == "learner rank 1"


def test_dump_a_range_of_steps(tmp_path):
    out = _run(tmp_path, steps=3)
    assert cli(["trace", "dump", out, "--steps", "2", "3", "-o", str(tmp_path / "part.json")]) == 0
    xs = check_trace_format(json.loads((tmp_path / "part.json").read_text()))
    assert {e["pid"] for e in xs} == {2, 3}
    assert {e["name"] for e in xs if e["name"].startswith("step ")} == {"step 2", "step 3"}


def test_dump_without_trace_fails_clearly(tmp_path, capsys):
    assert cli(["trace", "dump", str(tmp_path), "-o", str(tmp_path / "x.json")]) == 1
    assert "has no trace" in capsys.readouterr().err


def test_tracing_off_is_a_no_op():
    with trace.step(1), trace.span("rollout"):
        trace.trajectories([_traj("a/b/0", time.time(), 0.1)])
    assert trace.close() is None


@pytest.fixture(autouse=True)
def _no_leftover_tracer():
    yield
    trace._active = None
