"""Async RL's speed-up on a multi-turn tool job: the same job for the same number of trained samples at
`algo.max_staleness` 0, 1 and 2, with and without partial rollouts (`engine.partial_rollout`), one `rayrl train`
process each, in the same call. Per run: training wall time (the steps' `time/step_s`, validation excluded),
its ratio to the synchronous run of this call, the accelerator-busy share (`busy_share_from_trace`; without a
trace, generate + learner + weight sync from the step lines' phase shares), the policy-version span within
trajectories, the final validation accuracy (one validation after the last step), and the span of one batch's
generation (`batch_span`: what a staleness-k step waits on, while the update is the rest of it).

    python bench/async_speedup.py                                  # jobs/retool_tiny.yaml (the SFT'd tiny model)
    python bench/async_speedup.py --runs s0,s1p --steps 3 -- rollout.n=2
    python bench/async_speedup.py --job jobs/retool_tiny.yaml --out /tmp/async -- model.dtype=bfloat16 \\
        engine.gpus_per_engine=0.4 engine.gpu_memory_utilization=0.3 learner.gpus_per_worker=0.5   # one GPU

Run names: s<staleness> (partial rollouts off), s<staleness>p (on), s<staleness>k (on, with the KV cache kept across
weight updates: `engine.keep_kv_on_sync`). The first run is the peer the ratios divide by. A name given more than
once runs again (its k-th run in `<name>.<k>/`; e.g. `--runs s0,s1p,s1p,s0`, each side twice, in an order that
spreads a host's drift over both), and a second table gives each name's mean over its runs with their range: two
synchronous runs on one GPU host differed by 19% (BENCHMARKS.md, fourteenth session), more than one pair resolves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

RUNS = "s0,s1,s1p,s2,s2p"


def run_overrides(name: str) -> list[str]:
    """`s1p` -> staleness 1 with partial rollouts; `s1k` -> the same, the KV cache kept across updates."""
    partial, keep = name[-1:] in ("p", "k"), name.endswith("k")
    staleness = name[1:-1] if partial else name[1:]
    if not name.startswith("s") or not staleness.isdigit():
        raise SystemExit(f"async_speedup: run {name!r}: expected s<staleness>, s<staleness>p or s<staleness>k, "
                         "e.g. s0, s1p, s1k")
    # keep_kv_on_sync only when on: an older rayrl (a baseline run of a previous commit) does not know the field
    return [f"algo.max_staleness={staleness}", f"engine.partial_rollout={str(partial).lower()}",
            *(["engine.keep_kv_on_sync=true"] if keep else [])]


def staleness_of(name: str) -> int:
    return int(run_overrides(name)[0].partition("=")[2])


def labels(names: list[str]) -> list[str]:
    """Each run's label (its folder): the name, then `<name>.<k>` for its k-th run."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}.{seen[n]}")
    return out


def kind(label: str) -> str:
    """The run name of a label (`s1p.2` -> `s1p`)."""
    return label.partition(".")[0]


def summarize(metrics_path: str, staleness: int = 0) -> dict:
    """The figures of one run from its metrics.jsonl (`staleness`: the run's algo.max_staleness)."""
    with open(metrics_path) as f:
        steps = [m for m in map(json.loads, f) if m.get("step", 0) > 0 and "time/step_s" in m]
    if not steps:
        return {}
    def wall(part: list[dict]) -> float:
        return sum(map(wall_s, part))

    busy = [m.get("time/share_generate", 0) + m.get("time/share_learner", 0) + m.get("time/share_sync", 0)
            for m in steps]
    acc = next((v for k, v in sorted(steps[-1].items()) if k.startswith("val-core/") and "/acc/mean@" in k), None)
    return {"steps": len(steps), "wall_s": wall(steps), "busy_share": sum(busy) / len(busy),
            # without the first step (warm-up: compilation, the first calls) and the last (end-of-run checkpoint)
            "inner_wall_s": wall(steps[1:-1]) if len(steps) >= 3 else None,
            "version_span_max": max(m.get("policy/version_span_max", 0) for m in steps),
            "mixed_version_share": sum(m.get("policy/mixed_version_share", 0) for m in steps) / len(steps),
            "reward": steps[-1].get("reward/mean"), "val_acc": acc,
            # where a tool job's rollout waits: a sandbox call (slot wait included), the run alone, the worker's loop
            "sandbox_call_s": _mean(steps, "sandbox/latency_s"), "sandbox_run_s": _mean(steps, "sandbox/run_s"),
            "loop_lag_ms": _mean(steps, "rollout/loop_lag_mean_s", scale=1000),
            "batch_span_s": batch_span(steps, staleness)}


def batch_span(steps: list[dict], staleness: int, min_wait: float = 0.1) -> float | None:
    """The mean span of one batch's generation, from its tasks entering the queue to its last group, over steps 2..n-1
    that waited for their batch (`min_wait` s or more). The driver puts batch j in the queue when step j - staleness
    starts (rayrl.train's `feeder.fill`), and step j's rollout wait ends when the batch's last group is in, so the
    span is the `staleness` steps before j plus j's wait. Synchronous (0): the rollout time. When every step waits,
    steps settle at (span + the rest of a step) / (staleness + 1) (BENCHMARKS.md, twelfth session's async runs)."""
    spans = [sum(wall_s(m) for m in steps[j - staleness : j]) + steps[j]["time/rollout_s"]
             for j in range(max(1, staleness), len(steps) - 1) if steps[j].get("time/rollout_s", 0.0) >= min_wait]
    return sum(spans) / len(spans) if spans else None


def wall_s(m: dict) -> float:
    """One step's training wall: its time less validation."""
    return m["time/step_s"] - m.get("time/val_s", 0.0)


def busy_share_from_trace(path: str) -> float | None:
    """The share of the training wall during which the accelerator had work, from the run's trace.json: the union of
    the engines' LLM calls (every trajectory's), the learner's passes and the weight syncs, within the driver's
    steps (each step's rollout start to its end) less validation. The step lines' phase shares give each instant
    to one phase of the step's own rollout window, so they miss the generation an async run overlaps with the
    update (the next batch's trajectories belong to the next step)."""
    from rayrl.metrics import intersect, length, union
    from rayrl.trace import events

    spans: dict[str, list[tuple[float, float]]] = {}
    step_end: dict[int, float] = {}
    for e in events(path):
        if e.get("ph") != "X":
            continue
        a, b = e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6
        spans.setdefault(e["name"], []).append((a, b))
        if e["name"].startswith("step ") and e.get("tid") == 0:
            step_end[e["pid"]] = b
    rollouts = sorted(spans.get("rollout", []))
    if not rollouts or len(rollouts) != len(step_end):
        return None
    window = union([(r[0], end) for r, (_, end) in zip(rollouts, sorted(step_end.items()), strict=True)])
    val = union(spans.get("validate", []))
    busy = union(spans.get("llm", []) + spans.get("learner/train_step", []) + spans.get("learner/compute_logprobs", [])
                  + spans.get("weight_sync", []))
    wall = length(window) - length(intersect(window, val))
    inside = intersect(busy, window)
    return (length(inside) - length(intersect(inside, val))) / wall if wall > 0 else None


def _mean(steps: list[dict], key: str, scale: float = 1.0) -> float | None:
    """The mean of `key` over the steps that report it; None where none does (a run of an older rayrl)."""
    values = [m[key] * scale for m in steps if key in m]
    return sum(values) / len(values) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default="jobs/retool_tiny.yaml")
    p.add_argument("--runs", default=RUNS, help=f"comma-separated run names (default {RUNS}); the first is the peer")
    p.add_argument("--steps", type=int, default=4, help="training steps of every run (same trained samples)")
    p.add_argument("--out", default="outputs/async_speedup")
    p.add_argument("--val", default="reasoning_gym:basic_arithmetic", help="validation source (after the last step)")
    p.add_argument("--val-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--summarize", metavar="DIR[=TAG][,DIR...]",
                   help="no runs: the tables of DIR/<run>/ (metrics, trace) in each DIR that has it; a DIR's TAG "
                        "names its runs <run>+TAG, kept apart from untagged runs of that name (e.g. =mps for "
                        "runs with placement.mps=true)")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run (after --)")
    a = p.parse_args(argv)
    names = a.runs.split(",")
    for name in names:
        run_overrides(name)  # a bad name fails before any run starts
    if a.summarize:
        rows = [tagged(stored(d, label), tag) for d, _, tag in (e.partition("=") for e in a.summarize.split(","))
                for label in labels(names) if os.path.exists(os.path.join(d, label, "metrics.jsonl"))]
        table(rows)
        repeats(rows)
        return 0
    rows = []
    for name in labels(names):
        out = os.path.join(a.out, name)
        cmd = [sys.executable, "-m", "rayrl.train", a.job, *run_overrides(kind(name)), f"trainer.total_steps={a.steps}",
               f"trainer.output_dir={out}", "trainer.resume=disable", "trainer.save_freq=0",
               "trainer.save_interval_s=0", "trainer.export_hf=false", f"trainer.test_freq={a.steps}",
               "trainer.val_before_train=false", f"data.val_source=[{a.val}]", f"data.val_size={a.val_size}",
               *a.overrides]
        os.makedirs(out, exist_ok=True)
        print(f"async_speedup: {name}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        with open(os.path.join(out, "console.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:  # Ctrl-C: the run stops its actors and writes its trace
                proc.send_signal(signal.SIGINT)
                try:
                    rc = proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                print(f"async_speedup: {name}: stopped after --timeout {a.timeout:.0f} s", flush=True)
        row = {"run": name, "rc": rc, "process_s": time.perf_counter() - t0}
        metrics = os.path.join(out, "metrics.jsonl")
        row.update(summarize(metrics, staleness_of(kind(name))) if os.path.exists(metrics) else {})
        trace_path = os.path.join(out, "trace.json")
        if row.get("steps") and os.path.exists(trace_path):
            row["busy_share_phases"] = row["busy_share"]
            row["busy_share"] = busy_share_from_trace(trace_path)
        rows.append(row)
        print(f"async_speedup: {json.dumps(row)}", flush=True)
    with open(os.path.join(a.out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    table(rows)
    repeats(rows)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def stored(out: str, name: str) -> dict:
    """A finished run's row from its folder (exit status from results.jsonl where it is there)."""
    rcs = {}
    if os.path.exists(results := os.path.join(out, "results.jsonl")):
        with open(results) as f:
            rcs = {r["run"]: r["rc"] for r in map(json.loads, f)}
    row = {"run": name, "rc": rcs.get(name, "-"), **summarize(os.path.join(out, name, "metrics.jsonl"),
                                                                  staleness_of(kind(name)))}
    trace_path = next((t for t in (os.path.join(out, name, f) for f in ("trace.json", "trace.json.gz"))
                       if os.path.exists(t)), None)
    if row.get("steps") and trace_path:
        row["busy_share_phases"], row["busy_share"] = row["busy_share"], busy_share_from_trace(trace_path)
    return row


def tagged(row: dict, tag: str) -> dict:
    """A row of a tagged folder: `s1p` -> `s1p+mps`, `s1p.2` -> `s1p+mps.2` (its own name in the means table)."""
    if tag:
        name, dot, rest = row["run"].partition(".")
        row["run"] = f"{name}+{tag}{dot}{rest}"
    return row


def table(rows: list[dict]) -> None:
    peer, inner = rows[0].get("wall_s"), rows[0].get("inner_wall_s")
    print(f"\n| run | exit | steps | training wall s | vs {rows[0]['run']} | steps 2..n-1 s | vs {rows[0]['run']} | "
          "busy share | version span max | mixed-version trajectories | final reward | val acc | "
          "sandbox call / run s | loop lag ms | batch span s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['wall_s'] / peer:.2f}x" if peer and r.get("wall_s") else "-"
        inner_ratio = f"{r['inner_wall_s'] / inner:.2f}x" if inner and r.get("inner_wall_s") else "-"
        print(f"| {r['run']} | {r['rc']} | {r.get('steps', 0)} | {_fmt(r, 'wall_s', '.1f')} | {ratio} | "
              f"{_fmt(r, 'inner_wall_s', '.1f')} | {inner_ratio} | "
              f"{_fmt(r, 'busy_share', '.0%')} | {r.get('version_span_max', '-')} | "
              f"{_fmt(r, 'mixed_version_share', '.0%')} | {_fmt(r, 'reward', '.3f')} | {_fmt(r, 'val_acc', '.3f')} | "
              f"{_fmt(r, 'sandbox_call_s', '.2f')} / {_fmt(r, 'sandbox_run_s', '.3f')} | "
              f"{_fmt(r, 'loop_lag_ms', '.1f')} | {_fmt(r, 'batch_span_s', '.2f')} |")


def repeats(rows: list[dict]) -> None:
    """Where a run name ran more than once: each name's mean over its runs (the range in brackets) and the ratio of
    the means to the first name's; nothing otherwise."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("wall_s"):
            groups.setdefault(kind(r["run"]), []).append(r)
    if not groups or max(map(len, groups.values())) < 2:
        return

    def values(g: list[dict], key: str) -> list[float]:
        return [r[key] for r in g if r.get(key) is not None]

    def mean(g: list[dict], key: str) -> float | None:
        v = values(g, key)
        return sum(v) / len(v) if v else None

    def cell(g: list[dict], key: str, peer: float | None) -> str:
        if not (v := values(g, key)):
            return "- | -"
        m, spread = sum(v) / len(v), f" ({min(v):.1f}-{max(v):.1f})" if len(v) > 1 else ""
        return f"{m:.1f}{spread} | " + (f"{m / peer:.2f}x" if peer else "-")

    first = next(iter(groups.values()))
    peer, inner, base = mean(first, "wall_s"), mean(first, "inner_wall_s"), kind(first[0]["run"])
    print(f"\nMeans over repeated runs (vs {base}'s mean):")
    print(f"| run | runs | training wall s | vs {base} | steps 2..n-1 s | vs {base} | batch span s | val acc |")
    print("|---|---|---|---|---|---|---|---|")
    for name, g in groups.items():
        span, acc = mean(g, "batch_span_s"), mean(g, "val_acc")
        print(f"| {name} | {len(g)} | {cell(g, 'wall_s', peer)} | {cell(g, 'inner_wall_s', inner)} | "
              f"{'-' if span is None else f'{span:.2f}'} | {'-' if acc is None else f'{acc:.3f}'} |")


def _fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if row.get(key) is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
