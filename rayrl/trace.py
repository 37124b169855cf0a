"""Chrome trace events (open in https://ui.perfetto.dev) for every training phase and every trajectory.

Layout: one Perfetto *process* per training step ("step 3"). Its thread 0 ("driver") holds the step span
and the driver's phases nested in it (rollout, learner update -> train_step / compute_logprobs, weight
sync, validate, checkpoint); its other threads are lanes of trajectories, each trajectory span holding
what happened inside it (LLM calls with token counts, tool calls, sandbox runs, reward); the last threads,
one per learner rank, hold each train_step's forward / backward per micro-batch and optimizer step. Timestamps are
wall-clock `time.time()`, comparable across processes of one node.

While training, events go to `output_dir/trace/events.jsonl` (one line per event, tagged with its
step), flushed at the end of each step, so `rayrl trace dump RUN_DIR --steps A B -o trace.json` can
export any range afterwards, even after a crash; `train` writes `output_dir/trace.json` for the
whole run at the end.

Trajectory timing: a Trajectory carries durations (`timings`: agent, reward, total) and, when the
rollout side records them, `events` with absolute times (see rayrl.types.Trajectory.events). With
events, the trajectory's span starts at its first event (a rollout worker's first is the Gateway's
`gateway:open`, at the episode's start) and lasts `timings["total"]` (the reward is drawn at its
end); without, it ends when the driver received it (up to one poll later than it finished) and
starts `timings["total"]` seconds before that.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from rayrl.types import Trajectory

DRIVER_TID = 0
LEARNER_TID = 1_000_000  # + rank: one lane per learner rank (forward / backward / optimizer step), after trajectories
_active: Tracer | None = None  # the run's tracer; module-level so phases can be traced without threading it through


class Tracer:
    def __init__(self, output_dir: str):
        self.dir = os.path.join(output_dir, "trace")
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, "events.jsonl")
        self.step = 0  # the step events are tagged with (1-based, as in the step log); 0 = before training
        self.pending: list[dict] = []
        self.stack: list[str] = []
        self.received: dict[str, float] = {}  # task id -> wall time the driver got its trajectory
        self.lanes: dict[int, list[float]] = {}  # step -> end time of the last trajectory in each lane

    def add(self, name: str, start: float, end: float, tid: int = DRIVER_TID, cat: str = "driver",
            step: int | None = None, **args: Any) -> None:
        step = self.step if step is None else step
        self.pending.append({"step": step, "event": {"name": name, "cat": cat, "ph": "X", "pid": step, "tid": tid,
                                                     "ts": _us(start), "dur": max(_us(end) - _us(start), 0),
                                                     "args": _plain(args)}})

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        start = time.time()
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()
            self.add(name, start, time.time(), **args)

    def trajectories(self, trajs: list[Trajectory]) -> None:
        """One span per trajectory (in the current step's process) with its own events nested inside."""
        lanes = self.lanes.setdefault(self.step, [])
        now = time.time()
        spans = []
        for tr in trajs:
            evs = [e for e in tr.events if "start" in e and "end" in e]
            total = tr.timings.get("total", 0.0)
            if evs:  # the first event starts right after the episode does; `total` is measured from there
                start = min(e["start"] for e in evs)
                end = max([start + total] + [e["end"] for e in evs])
            else:
                end = self.received.get(tr.task_id, now)
                start = end - total
            spans.append((start, end, tr, evs))
        for start, end, tr, evs in sorted(spans, key=lambda s: s[0]):
            lane = next((i for i, busy_until in enumerate(lanes) if busy_until <= start), len(lanes))
            if lane == len(lanes):
                lanes.append(end)
            else:
                lanes[lane] = end
            tid = lane + 1
            self.add(f"trajectory {tr.task_id}", start, end, tid=tid, cat="trajectory", task_id=tr.task_id,
                     reward=tr.reward, error=tr.error, prompt_tokens=len(tr.prompt_ids),
                     response_tokens=len(tr.response_ids), trained_tokens=sum(tr.loss_mask), turns=tr.num_turns,
                     finish_reason=tr.finish_reason, policy_version=tr.policy_version, worker=tr.worker)
            if not evs and "agent" in tr.timings:  # no per-call events: agent, then reward, from the durations
                a_end = start + tr.timings["agent"]
                evs = [{"name": "agent", "start": start, "end": a_end},
                       {"name": "reward", "start": a_end, "end": min(end, a_end + tr.timings.get("reward", 0.0))}]
            elif tr.timings.get("reward") and not any(e["name"] == "reward" for e in evs):
                r0 = max([start, end - tr.timings["reward"]] + [e["end"] for e in evs])  # after the agent's spans
                evs = [*evs, {"name": "reward", "start": r0, "end": end}]
            for e in evs:  # clamped into the trajectory so viewers nest them under it
                s, t = max(e["start"], start), min(e["end"], end)
                self.add(e["name"], s, max(s, t), tid=tid, cat=e.get("cat", "episode"), **e.get("args", {}))

    def learner(self, events: list[dict], start: float, end: float) -> None:
        """Learner-side spans (rayrl.types.StepStats.events) on one lane per rank, clamped into [start, end], the
        driver's span around the call, so they nest in it even with clocks of other nodes slightly off."""
        for e in events:
            s = min(max(e["start"], start), end)
            rank = e.get("rank", 0)
            self.add(e["name"], s, min(max(e["end"], s), end), tid=LEARNER_TID + rank, cat="learner", rank=rank,
                     **e.get("args", {}))

    def flush(self) -> None:
        if not self.pending:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in self.pending)
        self.pending.clear()


def start(output_dir: str) -> Tracer:
    global _active
    _active = Tracer(output_dir)
    return _active


def close() -> str | None:
    """Flush and write output_dir/trace.json for every step recorded. Returns its path."""
    global _active
    t, _active = _active, None
    if t is None:
        return None
    t.flush()
    return dump(os.path.dirname(t.dir), None, None, os.path.join(os.path.dirname(t.dir), "trace.json"))


@contextlib.contextmanager
def step(n: int) -> Iterator[None]:
    """Tag what happens inside with step n; then record the step's span (from its start, or from its earliest
    trajectory when tasks were queued ahead of it, async RL) and flush the step's events to disk."""
    if _active is None:
        yield
        return
    _active.flush()
    _active.step, start = n, time.time()
    try:
        yield
    finally:
        first = min([start] + [e["event"]["ts"] / 1e6 for e in _active.pending if e["event"]["tid"] != DRIVER_TID])
        _active.add(f"step {n}", first, time.time(), cat="step")
        _active.flush()


@contextlib.contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """Trace a driver phase; nests inside the phase around it. A no-op when tracing is off."""
    if _active is None:
        yield
        return
    with _active.span(name, **args):
        yield


def received(trajs: list[Trajectory]) -> None:
    if _active is not None:
        now = time.time()
        for tr in trajs:
            _active.received.setdefault(tr.task_id, now)


def trajectories(trajs: list[Trajectory]) -> None:
    if _active is not None:
        _active.trajectories(trajs)


def learner(events: list[dict], start: float, end: float) -> None:
    """Add learner spans (StepStats.events of every rank) nested in the driver's span [start, end] around the call."""
    if _active is not None:
        _active.learner(events, start, end)


def dump(run_dir: str, first: int | None, last: int | None, out: str) -> str:
    """Write the events of steps first..last (inclusive; None = open-ended) of a run as one Chrome trace file."""
    path = os.path.join(run_dir, "trace", "events.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir!r} has no trace (no {path}); was it trained with trainer.trace=true?")
    events, steps = [], set()
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            s = rec["step"]
            if (first is None or s >= first) and (last is None or s <= last):
                events.append(rec["event"])
                steps.add(s)
    meta = []
    for s in sorted(steps):
        meta.append({"name": "process_name", "ph": "M", "pid": s, "tid": 0,
                     "args": {"name": f"step {s}" if s else "setup / validation before training"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": s, "tid": 0, "args": {"sort_index": s}})
        meta.append({"name": "thread_name", "ph": "M", "pid": s, "tid": DRIVER_TID, "args": {"name": "driver"}})
        for tid in sorted({e["tid"] for e in events if e["pid"] == s} - {DRIVER_TID}):
            name = f"learner rank {tid - LEARNER_TID}" if tid >= LEARNER_TID else f"trajectories {tid}"
            meta.append({"name": "thread_name", "ph": "M", "pid": s, "tid": tid, "args": {"name": name}})
    tmp = out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump({"traceEvents": meta + sorted(events, key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"])),
                   "displayTimeUnit": "ms", "otherData": {"run_dir": os.path.abspath(run_dir)}}, f)
    os.replace(tmp, out)
    return out


def events(path: str) -> list[dict]:
    """The events of a Chrome trace file that `dump` (or `train`) wrote, gzipped or not."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _us(t: float) -> int:
    return round(t * 1e6)


def _plain(args: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in args.items()}
