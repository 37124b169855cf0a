"""The driver's own time around each step's update, from a run's trace.json (trainer.trace): seconds from the end
of the rollout to the first train_step (advantages, shards) and from the last train_step to the weight sync
(rollout_correction's metrics, the step's bookkeeping). Work the driver does while the engines wait. Also, per
step, seconds from the rollout's start to its first trajectory's (how long the step waited for episodes to begin;
negative where an async run began them during the step before), and the median seconds of its episodes' LLM calls
and sandbox runs (the first step's show what a cold engine and cold sandboxes cost).

    python bench/gpu/driver_gaps.py RUN_DIR/trace.json[.gz] [...]
"""

from __future__ import annotations

import statistics
import sys

from rayrl.trace import events


def gaps(path: str) -> list[tuple[int, float, float, float | None]]:
    steps: dict[int, dict[str, list[dict]]] = {}
    first: dict[int, float] = {}  # each step's earliest trajectory start (its lanes: pid = step, tid > 0)
    for e in events(path):  # the driver's lane of each step (pid = step, tid 0)
        if e.get("ph") == "X" and e.get("tid") == 0:
            steps.setdefault(e["pid"], {}).setdefault(e["name"], []).append(e)
        elif e.get("ph") == "X" and e["name"].startswith("trajectory "):
            first[e["pid"]] = min(first.get(e["pid"], e["ts"]), e["ts"])
    out = []
    for step, spans in sorted(steps.items()):
        if not all(k in spans for k in ("rollout", "learner/train_step", "weight_sync")):
            continue
        roll, sync = spans["rollout"][0], spans["weight_sync"][0]
        train = sorted(spans["learner/train_step"], key=lambda e: e["ts"])
        before = (train[0]["ts"] - roll["ts"] - roll["dur"]) / 1e6
        after = (sync["ts"] - train[-1]["ts"] - train[-1]["dur"]) / 1e6
        begin = (first[step] - roll["ts"]) / 1e6 if step in first else None
        out.append((step, before, after, begin))
    return out


def call_medians(path: str, names: tuple[str, ...] = ("llm", "sandbox")) -> dict[int, dict[str, float]]:
    """Per step (a trace's pid): the median duration in seconds of each kind of call its episodes made."""
    durations: dict[int, dict[str, list[float]]] = {}
    for e in events(path):
        if e.get("ph") == "X" and e["name"] in names:
            durations.setdefault(e["pid"], {}).setdefault(e["name"], []).append(e["dur"] / 1e6)
    return {step: {name: statistics.median(d) for name, d in kinds.items()} for step, kinds in durations.items()}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        rows = gaps(path)
        mid = rows[1:-1]  # the first (warm-up) and last (checkpoint, validation) steps apart
        print(f"{path}: rollout->update / update->sync s per step: "
              + " ".join(f"{s}:{b:.2f}/{a:.2f}" for s, b, a, _ in rows))
        print("  rollout->first trajectory s per step: "
              + " ".join(f"{s}:{'-' if f is None else format(f, '.2f')}" for s, _, _, f in rows))
        medians = call_medians(path)
        for name in ("llm", "sandbox"):
            print(f"  median {name} call s per step: "
                  + " ".join(f"{s}:{m[name]:.2f}" for s, m in sorted(medians.items()) if name in m))
        if mid:
            print(f"  steps 2..{rows[-2][0]}: mean {sum(r[1] for r in mid) / len(mid):.3f} / "
                  f"{sum(r[2] for r in mid) / len(mid):.3f} s, max {max(r[1] for r in mid):.2f} / "
                  f"{max(r[2] for r in mid):.2f} s")
