"""What the chaos runs train with (rollout.agent / reward.fn: "tests.chaos.roles:<name>"; top-level so actors and the
reward pool's processes import them), and how they kill a role and count a run's task ids."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter

import ray

from tests.helpers import digit_count

HANG = "HANG"  # an answer the scorer below never finishes scoring


async def agent(ctx, config: dict) -> dict:
    """One LLM call and one sandbox run, after a random wait (so episodes are in flight whenever a role dies).
    `config["hang"]`: task id -> what never answers in that episode: "agent", "reward" or "sandbox"."""
    await asyncio.sleep(random.uniform(0.0, config.get("sleep", 1.0)))
    hang = config.get("hang", {}).get(ctx.task.task_id)
    if hang == "agent":
        await asyncio.sleep(10**6)
    reply = await ctx.llm.chat.completions.create(messages=ctx.messages, max_tokens=8)
    code = "import time; time.sleep(10**6)" if hang == "sandbox" else "print(1)"
    r = await ctx.sandbox.run(code, "python", None)
    if not r.ok:
        raise RuntimeError(f"the sandbox run failed: {r.error or r.stderr[-200:]}")
    return {"reward": None, "answer": HANG if hang == "reward" else reply.choices[0].message.content, "metadata": {}}


def score(data_source: str, solution_str: str, ground_truth, extra_info: dict) -> float:
    if solution_str == HANG:
        time.sleep(10**6)
    return digit_count(data_source, solution_str, ground_truth, extra_info)


def pid(name: str) -> int:
    """The process id of the named actor of this run."""
    return ray.get(ray.get_actor(name).__ray_call__.remote(lambda _self: os.getpid()), timeout=120)


def kill(name: str) -> int:
    """SIGKILL the named actor's process (as the OOM killer or a lost node would); returns the pid."""
    p = pid(name)
    os.kill(p, signal.SIGKILL)
    return p


def steps_logged(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def in_flight() -> int:
    """Tasks leased to workers right now (0 when the queue cannot say)."""
    try:
        return ray.get(ray.get_actor("rayrl/queue").stats.remote(), timeout=5)["leased"]
    except Exception:  # noqa: BLE001 - the queue may be restarting: nothing in flight as far as we know
        return 0


def ledger(out: str, steps: int, tasks_per_step: int, prompts: int) -> dict:
    """From the run's trace: per step, the trajectories it collected (task ids) against the tasks it issued
    (s<k>/p<i>/<j>). Returns issued, collected, lost, duplicated and the errors by task id."""
    seen: dict[int, Counter] = {s: Counter() for s in range(1, steps + 1)}
    errors: dict[str, str] = {}
    with open(os.path.join(out, "trace", "events.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            ev = rec.get("event", {})
            if ev.get("cat") == "trajectory" and rec["step"] in seen:
                tid = ev["args"]["task_id"]
                seen[rec["step"]][tid] += 1
                if ev["args"].get("error"):
                    errors[tid] = ev["args"]["error"]
    n = tasks_per_step // prompts
    issued = {s: {f"s{s - 1}/p{i}/{k}" for i in range(prompts) for k in range(n)} for s in seen}
    return {"issued": sum(len(v) for v in issued.values()),
            "collected": sum(sum(c.values()) for c in seen.values()),
            "lost": sorted(t for s in seen for t in issued[s] - set(seen[s])),
            "duplicated": sorted(t for s in seen for t, c in seen[s].items() if c > 1 or t not in issued[s]),
            "errors": errors}
