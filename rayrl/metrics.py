"""Step metrics to the console (progress bar + one line per step), metrics.jsonl, tensorboard and wandb, and
live gauges to the Ray Dashboard (ray.util.metrics -> each node's Prometheus endpoint, as `ray_rayrl_*`)."""

from __future__ import annotations

import json
import os
import sys

CONSOLE_KEYS = [("reward/mean", "reward {:.3f}"), ("reward/std", "±{:.3f}"), ("tools/call_rate", "tool use {:.0%}"),
                ("tools/calls_mean", "calls {:.2f}"), ("response/length_mean", "len {:.0f}"),
                ("rollout/tokens_per_s", "rollout {:.0f} tok/s"), ("time/step_s", "step {:.1f}s"),
                ("trajectories/failed", "failed {:.0f}"), ("actor/loss", "loss {:+.4f}"),
                ("actor/entropy", "entropy {:.3f}"), ("actor/grad_norm", "gnorm {:.3f}"),
                ("sync/seconds", "sync {:.2f}s"), ("policy/version", "v{:.0f}"),
                # rayrl sft's steps
                ("sft/loss", "loss {:.4f}"), ("sft/val_loss", "val_loss {:.4f}"), ("sft/lr", "lr {:.2e}"),
                ("sft/grad_norm", "gnorm {:.3f}"), ("sft/tokens_per_s", "{:.0f} tok/s"), ("sft/epoch", "epoch {:.2f}")]

# Dashboard gauge -> (the step-metrics key it shows, its help). Tagged with the run's experiment name.
DASHBOARD = {
    "rayrl_reward_mean": ("reward/mean", "mean reward of the last step's successful trajectories"),
    "rayrl_step_seconds": ("time/step_s", "seconds the last training step took"),
    "rayrl_rollout_tokens_per_s": ("rollout/tokens_per_s", "generated tokens per second of the last step's rollout"),
    "rayrl_failed_trajectories": ("trajectories/failed", "failed trajectories in the last step"),
    "rayrl_sandbox_latency_seconds": ("sandbox/latency_s",
                                      "mean sandbox call seconds in the last step, slot wait included (0: none)"),
    "rayrl_weight_sync_seconds": ("sync/seconds", "seconds the last learner -> engines weight sync took"),
    "rayrl_policy_version": ("policy/version", "the engines' policy version"),
    "rayrl_staleness": ("policy/staleness_max", "most policy versions a trajectory of the last step lagged behind"),
    "rayrl_queue_depth": ("queue/pending", "tasks waiting in the TaskQueue"),
    "rayrl_leases_in_flight": ("queue/leased", "tasks leased by rollout workers, not yet acked"),
}
_gauges: dict = {}


def dashboard(m: dict[str, float], run: str) -> None:
    """Set the Dashboard gauges that `m` has values for (a no-op outside Ray)."""
    import ray

    if not ray.is_initialized():
        return
    if not _gauges:
        from ray.util.metrics import Gauge

        _gauges.update({name: Gauge(name, description=help_, tag_keys=("run",))
                        for name, (_, help_) in DASHBOARD.items()})
    for name, (key, _) in DASHBOARD.items():
        if key in m and m[key] is not None:
            _gauges[name].set(float(m[key]), tags={"run": run})


class StepLogger:
    def __init__(self, output_dir: str, loggers: list[str], total_steps: int, start_step: int, run_config: dict,
                 name: str, project: str = "rayrl"):
        from tqdm import tqdm

        os.makedirs(output_dir, exist_ok=True)
        self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.console = "console" in loggers
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stdout,
                        disable=not self.console, dynamic_ncols=True)
        self.name = name
        self.output_dir = output_dir
        self.tb = self.wandb = None
        self._generations: list[list] = []  # every validation's rows so far: wandb tables are rebuilt whole
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError("trainer.logger has 'tensorboard' but the tensorboard package is not installed "
                                   "(pip install tensorboard)") from None
            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard", project, name))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("trainer.logger has 'wandb' but wandb is not installed "
                                   "(pip install wandb)") from None
            # WANDB_MODE=offline works without an account; the run syncs later with `wandb sync`.
            mode = os.environ.get("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=project, name=name, config=run_config, dir=output_dir, mode=mode)

    def log(self, step: int, m: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, **m}) + "\n")
        self.jsonl.flush()
        dashboard(m, self.name)
        if self.tb is not None:
            for k, v in m.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(m, step=step)
        if self.console:
            parts = [fmt.format(m[k]) for k, fmt in CONSOLE_KEYS if k in m]
            parts += [f"val {k[len('val-core/'):k.rindex('/acc/')]} acc{k[k.rindex('@'):]} {v:.3f}"
                      for k, v in m.items() if k.startswith("val-core/") and "/acc/mean@" in k]
            parts += [f"val {k[len('val-aux/'):-len('/tools/call_rate')]} tool use {v:.0%}"
                      for k, v in m.items() if k.startswith("val-aux/") and k.endswith("/tools/call_rate")]
            self.bar.write(f"step {step}: " + "  ".join(parts))
            self.bar.update(max(step - self.bar.n, 0))  # step 0 (validation before training) is no step done

    def generations(self, step: int, rows: list[dict]) -> None:
        """`trainer.log_val_generations`: one validation's sampled generations (`val_generations`) to
        output_dir/val_generations.jsonl, tensorboard text and a wandb table (verl's `val/generations`)."""
        with open(os.path.join(self.output_dir, "val_generations.jsonl"), "a") as f:
            f.writelines(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in rows)
        if self.tb is not None:
            self.tb.add_text("val/generations", "".join(
                f"### Sample {i + 1} ({r['data_source']})\n**Input:** {r['prompt']}\n\n**Output:** {r['response']}"
                f"\n\n**Score:** {r['score']}\n\n---\n\n" for i, r in enumerate(rows)), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self._generations += [[step, r["data_source"], r["prompt"], r["response"], r["score"]] for r in rows]
            self.wandb.log({"val/generations": wandb.Table(
                columns=["step", "data_source", "prompt", "response", "score"], data=self._generations)}, step=step)

    def info(self, text: str) -> None:
        if self.console:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def summarize(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


def val_metrics(trajs: list) -> dict[str, float]:
    """Validation metrics per data source, computed and named as verl does: its `process_validation_metrics` over
    each sample's acc and reward (pred, the extracted answer, is maj@n's vote), grouped by prompt;
    `val-core/<source>/acc/{mean,best,maj}@n...` for the largest n (samples per prompt), everything else
    `val-aux/...`. acc is on a 0-1 scale (`val_acc`) and a failed sample counts 0 (verl 0.9 counts a missing
    sample's acc 0 too); reward is the trained reward of the successful samples only. Tool-using agents' samples
    also give the training steps' `tool_metrics` per source, as `val-aux/<source>/tools/call_rate` etc."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics  # the driver has verl loaded already

    from rayrl.rewards import extract_answer

    def pred(t) -> str:
        return (extract_answer(str(t.answer)) or "") if t.ok else ""

    ok = [t for t in trajs if t.ok]
    # two calls, as verl 0.6's takes no None for a sample without a value (verl 0.9's would skip it)
    metrics = [process_validation_metrics([t.data_source for t in ts], [t.group_id for t in ts], infos)
               for ts, infos in ((trajs, {"acc": [val_acc(t) for t in trajs], "pred": [pred(t) for t in trajs]}),
                                 (ok, {"reward": [t.reward for t in ok], "pred": [pred(t) for t in ok]}))]
    out: dict[str, float] = {}
    for source in sorted({s for m in metrics for s in m}):
        for var, metric in [vm for m in metrics for vm in m.get(source, {}).items()]:
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric)
            for name, value in metric.items():  # verl's ray_trainer._val_metrics_update, with acc as the core var
                core = var == "acc" and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(value)
    for source in sorted({t.data_source for t in trajs}):
        tools = tool_metrics([t for t in trajs if t.data_source == source])
        out.update({f"val-aux/{source}/{k}": v for k, v in tools.items()})
    out["val-aux/failed"] = float(sum(not t.ok for t in trajs))
    return out


def val_acc(t) -> float:
    """A validation sample's accuracy in [0, 1]: its score before the overlong penalty, clipped. math_dapo's and
    ReTool's +1 / negative scores give verl's acc 1 / 0; a 0-1 scorer's score is its acc (verl: acc = score for a
    scorer that returns a number). A failed sample: 0."""
    if not t.ok:
        return 0.0
    return min(max(t.reward - t.metadata.get("overlong_penalty", 0.0), 0.0), 1.0)


def val_generations(trajs: list, n: int, decode) -> list[dict]:
    """The `trainer.log_val_generations` samples, picked as verl picks them (sorted by prompt, shuffled with seed
    42, the first n): data_source, prompt and response text (`decode(token_ids)`, tool results included), score
    (the reward; None for a failed sample, which also gets its error)."""
    import numpy as np

    picked = sorted(((decode(t.prompt_ids), t.task_id, t) for t in trajs), key=lambda p: p[:2])
    np.random.RandomState(42).shuffle(picked)
    return [{"data_source": t.data_source, "prompt": prompt, "response": decode(t.response_ids),
             "score": t.reward if t.ok else None, **({"error": t.error} if t.error else {})}
            for prompt, _, t in picked[:n]]


def tool_metrics(trajs: list) -> dict[str, float]:
    """From what tool-using agents put in their metadata (rayrl.agents.tool_agent): tool calls per trajectory, the
    share of trajectories with at least one call, the sandbox error rate per call and, when any call ran, the
    success rate: the share of calls that ran and exited 0 (no tool, sandbox or code error)."""
    tooled = [t.metadata for t in trajs if "tool_calls" in (t.metadata or {})]
    if not tooled:
        return {}
    calls = sum(m["tool_calls"] for m in tooled)
    out = {"tools/calls_mean": calls / len(tooled),
           "tools/call_rate": sum(1 for m in tooled if m.get("tool_calls", 0) > 0) / len(tooled),
           "sandbox/error_rate": sum(m.get("sandbox_errors", 0) for m in tooled) / max(calls, 1)}
    if calls:
        failed = sum(m.get(k, 0) for m in tooled for k in ("tool_errors", "sandbox_errors", "code_errors"))
        out["tools/success_rate"] = (calls - failed) / calls
    return out


def version_metrics(trajs: list) -> dict[str, float]:
    """Partial rollouts (engine.partial_rollout): how many policy versions produced each trajectory's sampled tokens
    (span = newest - oldest; 0 when one version sampled all of them), and the share of trajectories that span more
    than one."""
    spans = [max(v) - min(v) for v in ([x for x in t.versions if x >= 0] for t in trajs if t.ok) if v]
    if not spans:
        return {}
    return {"policy/version_span_max": max(spans), "policy/version_span_mean": sum(spans) / len(spans),
            "policy/mixed_version_share": sum(1 for s in spans if s) / len(spans)}


def phase_shares(trajs: list, start: float, rollout_end: float, learner_s: float, sync_s: float,
                 step_s: float) -> dict[str, float]:
    """Where a step's wall time went, as shares summing to 1. During the rollout window each instant goes to the
    first busy phase of: generate (an LLM call in flight), tool (a tool or sandbox run), reward (scoring), else
    rollout idle (agent code, queue and Ray overhead, waiting on stragglers). Then learner, weight sync, and other
    (validation, checkpoint, driver). Times are wall-clock (`time.time()`) from the trajectories' events."""
    kinds = {"llm": "generate", "sandbox": "tool", "reward": "reward"}
    spans: dict[str, list[tuple[float, float]]] = {"generate": [], "tool": [], "reward": []}
    for t in trajs:
        for e in t.events:
            name = e.get("name", "")
            kind = kinds.get(name) or ("tool" if name.startswith(("tool", "sandbox")) else None)
            if kind and "start" in e and "end" in e:
                spans[kind].append((max(e["start"], start), min(e["end"], rollout_end)))
    taken: list[tuple[float, float]] = []
    out = {}
    for kind in ("generate", "tool", "reward"):
        mine = union(spans[kind])
        out[kind] = length(mine) - length(intersect(mine, taken))
        taken = union(taken + mine)
    window = max(rollout_end - start, 0.0)
    out["rollout_idle"] = max(window - length(taken), 0.0)
    out["learner"], out["sync"] = learner_s, sync_s
    out["other"] = max(step_s - window - learner_s - sync_s, 0.0)
    total = sum(out.values()) or 1.0
    return {f"time/share_{k}": v / total for k, v in out.items()}


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Time spans (start, end) merged where they overlap, in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where the spans of `xs` overlap those of `ys` (each list without overlaps of its own: union)."""
    return [(max(a, c), min(b, d)) for a, b in xs for c, d in ys if min(b, d) > max(a, c)]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)
