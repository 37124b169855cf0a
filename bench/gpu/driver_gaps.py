"""The driver's own time around each step's update, from a run's trace.json (trainer.trace): seconds from the end
of the rollout to the first train_step (advantages, shards) and from the last train_step to the weight sync
(rollout_correction's metrics, the step's bookkeeping). Work the driver does while the engines wait. Also, per
step, seconds from the rollout's start to its first trajectory's (how long the step waited for episodes to begin;
negative where an async run began them during the step before), and the median seconds of its episodes' LLM calls
and sandbox runs (the first step's show what a cold engine and cold sandboxes cost); and the engine's tokens per
second against the LLM calls open, with and without a learner step running (`call_rates`).

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


BINS = ((1, 50), (50, 100), (100, 200), (200, 300), (300, 400), (400, 1000))


def call_rates(path: str, tick: float = 0.05) -> list[tuple[int, int, str, float, float, float]]:
    """How fast the engine answered against how many LLM calls were open, in steps 2..n-1 (warm, no validation):
    every `tick` s, the calls open and their tokens per second (each call's completion tokens spread evenly over
    its span), binned by calls open and split by whether a learner train_step ran then. Rows: (lo, hi, "learner
    on"/"learner off", seconds, tok/s, tok/s per open call)."""
    import numpy as np

    evs = [e for e in events(path) if e.get("ph") == "X"]
    steps = sorted({e["pid"] for e in evs if e.get("tid") == 0 and e["name"] == "rollout"})
    inner = set(steps[1:-1])
    calls = [(e["ts"], e["ts"] + e["dur"], (e.get("args") or {}).get("completion_tokens", 0))
             for e in evs if e["name"] == "llm" and e["pid"] in inner and e["dur"] > 0]
    train = [(e["ts"], e["ts"] + e["dur"]) for e in evs
             if e.get("tid") == 0 and e["name"] == "learner/train_step" and e["pid"] in inner]
    if not calls:
        return []
    grid = np.arange(min(a for a, _, _ in calls), max(b for _, b, _ in calls), tick * 1e6)
    rate, open_ = np.zeros(len(grid)), np.zeros(len(grid))
    for a, b, n in calls:
        i, j = np.searchsorted(grid, a), np.searchsorted(grid, b)
        rate[i:j] += n / ((b - a) / 1e6)
        open_[i:j] += 1
    learning = np.zeros(len(grid), bool)
    for a, b in train:
        learning[(grid >= a) & (grid < b)] = True
    rows = []
    for lo, hi in BINS:
        for name, mask in (("learner on", learning), ("learner off", ~learning)):
            m = (open_ >= lo) & (open_ < hi) & mask
            if m.any():
                rows.append((lo, hi, name, m.sum() * tick, rate[m].mean(), rate[m].mean() / open_[m].mean()))
    return rows


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
        print("  LLM calls open -> tok/s (steps 2..n-1): "
              + "; ".join(f"{lo}-{hi} {name} {sec:.1f} s: {tps:.0f} tok/s, {per:.1f} per call"
                          for lo, hi, name, sec, tps, per in call_rates(path)))
