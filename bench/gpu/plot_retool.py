"""The ReTool learning run on one GPU: validation accuracy and tool-call rate per step, with the training batch's,
from the run's metrics.jsonl (bench/gpu/retool_gpu.sh rl).
    python bench/gpu/plot_retool.py bench/gpu/results/2026-12-04/retool_rl_metrics.jsonl docs/gpu_retool_learning.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _first(row: dict, prefix: str, suffix: str) -> float | None:
    return next((v for k, v in row.items() if k.startswith(prefix) and k.endswith(suffix)), None)


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in open(src)]
    train = [r for r in rows if "reward/mean" in r]
    val = [(r["step"], acc, _first(r, "val-aux/", "/tools/call_rate")) for r in rows
           if (acc := next((v for k, v in r.items() if k.startswith("val-core/") and "/acc/mean@" in k), None))
           is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    ax1.plot([r["step"] for r in train], [r["reward/mean"] for r in train], color="tab:blue", alpha=0.5,
             label="train reward (32 prompts x 8 samples)")
    ax1.plot([s for s, _, _ in val], [a for _, a, _ in val], "o-", color="tab:red",
             label="validation accuracy (256 held-out prompts, 1 sample, T=1)")
    for s, a, _ in (val[0], val[-1]):
        ax1.annotate(f"{a:.3f}", (s, a), textcoords="offset points", xytext=(0, -14), ha="center", color="tab:red")
    ax1.set_ylabel("reasoning-gym score (1 = correct)")
    ax2.plot([r["step"] for r in train], [r["tools/call_rate"] for r in train], color="tab:blue", alpha=0.5,
             label="train episodes with a tool call")
    ax2.plot([s for s, _, _ in val], [c for _, _, c in val], "o-", color="tab:green",
             label="validation episodes with a tool call")
    ax2.set_ylabel("share of episodes calling code_interpreter")
    for ax in (ax1, ax2):
        ax.set_xlabel("step (policy version; 0 = the SFT model)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("SmolLM2-135M: cold-start SFT on tool traces, then GRPO with the code interpreter "
                 "(basic_arithmetic, 2-5 terms), one H200", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
