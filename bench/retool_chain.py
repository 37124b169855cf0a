"""The figures of a ReTool RL run (BENCHMARKS.md "ReTool chain on CPU"), from what the run wrote: per training step
the reward and tool-call rate of its step line (metrics.jsonl), and from its trace (trace/events.jsonl) the sandbox
runs executed, the trajectories' response tokens, how many of them were trained on (the model's sampled tokens) and
how many were masked out of the loss (tool results and the chat template's turn headers between turns).

    python bench/retool_chain.py outputs/retool_tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def figures(run_dir: str) -> list[dict]:
    """One dict per training step (validation trajectories, task ids "val...", left out)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = {m["step"]: m for m in map(json.loads, f) if m.get("step", 0) > 0 and "reward/mean" in m}
    per: dict[int, dict] = defaultdict(lambda: defaultdict(int))
    with open(os.path.join(run_dir, "trace", "events.jsonl")) as f:
        for rec in map(json.loads, f):
            e, s = rec["event"], per[rec["step"]]
            if e["name"].startswith("trajectory ") and not e["args"].get("task_id", "").startswith("val"):
                s["trajectories"] += 1
                s["response_tokens"] += e["args"]["response_tokens"]
                s["trained_tokens"] += e["args"]["trained_tokens"]
            elif e["name"] == "sandbox" and e["cat"] == "tool":
                s["sandbox_runs"] += 1  # spans of validation episodes are in step 0 (before training)
    out = []
    for step, m in sorted(metrics.items()):
        s = per[step]
        out.append({"step": step, "reward": m["reward/mean"], "tool_call_rate": m.get("tools/call_rate"),
                    "tool_calls_mean": m.get("tools/calls_mean"), "trajectories": s["trajectories"],
                    "failed": m.get("trajectories/failed"), "sandbox_runs": s["sandbox_runs"],
                    "response_tokens": s["response_tokens"], "trained_tokens": s["trained_tokens"],
                    "masked_tokens": s["response_tokens"] - s["trained_tokens"], "step_s": m.get("time/step_s")})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the RL job's trainer.output_dir")
    a = p.parse_args(argv)
    rows = figures(a.run_dir)
    print("| step | reward | tool-call rate | calls / episode | trajectories (failed) | sandbox runs | response "
          "tokens | trained | masked (tool + turn headers) | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['reward']:.3f} | {r['tool_call_rate']:.0%} | {r['tool_calls_mean']:.2f} | "
              f"{r['trajectories']} ({r['failed']:.0f}) | {r['sandbox_runs']} | {r['response_tokens']} | "
              f"{r['trained_tokens']} | {r['masked_tokens']} | {r['step_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
