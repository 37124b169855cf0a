"""Reward curve of a rayrl run: training reward per step and validation score, from metrics.jsonl.
    python bench/gpu/plot_rewards.py bench/gpu/results/2026-12-02/train_metrics.jsonl docs/gpu_smollm2_reward.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _val_key(row: dict) -> str | None:
    """Validation accuracy (0-1): verl's val-core/<source>/acc/mean@n; older runs logged val/reward_mean (-1..1)."""
    return next((k for k in row if k.startswith("val-core/") and "/acc/mean@" in k),
                "val/reward_mean" if "val/reward_mean" in row else None)


def main(src: str, dst: str,
         title: str = "SmolLM2-135M-Instruct, GRPO on reasoning-gym basic_arithmetic, one H200") -> None:
    rows = [json.loads(line) for line in open(src)]
    tr = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    va = [(r["step"], r[k]) for r in rows if (k := _val_key(r))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*tr, strict=True), color="tab:blue", alpha=0.6, label="train reward (mean of 32 prompts x 8 samples)")
    ax.plot(*zip(*va, strict=True), "o-", color="tab:red",
            label="validation score (256 prompts generated with seed 2, 1 sample each)")
    for s, v in (va[0], va[-1]):
        ax.annotate(f"{v:.3f}", (s, v), textcoords="offset points", xytext=(0, 8), ha="center", color="tab:red")
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("reasoning-gym score (1 = correct)")
    ax.set_ylim(0, max(0.6, max(v for _, v in tr) + 0.05))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
