"""Seed scale on one GPU (issue #14): the learner on the seed shapes at the seed lengths, one case per process.

    python bench/gpu/bench_seed.py CASE [--out DIR] [--label CODE] [--profile NAME]
    CASE: shape:tie:ckpt:compile[:budget[:offload[:reshard[:head[:dead]]]]]
    e.g. qwen3-4b:tied:ckpt:compile   qwen3-4b:untied:nockpt:eager   qwen2.5-7b:-:ckpt:compile:18432:optimizer
    ckpt: ckpt | nockpt | keepattn (checkpointing that keeps the attention outputs:
          model.gradient_checkpointing_keep_attention)
    offload: - (none) | optimizer (learner.optimizer_offload: the AdamW state on the GPU for the step only)
    reshard: - (the learner's default) | reshard (learner.reshard_after_forward=true) | keep (false)
    head: fused (the learner's: the lm_head inside the chunked log-prob kernel) | plain (the straightforward peer:
          the [tokens x vocab] logits of the lm_head, then the same chunked log-probs)
    dead: how many of the 4 sequences have advantage 0 (default 0): rows no gradient reaches, as in GRPO groups
          whose rewards are all equal

Random-init models of each shape (rayrl.models.make_model, built on the GPU, Qwen's tokenizer) train on 4 sequences
of 2,048 prompt + 14,336 response tokens (random tokens, advantages +-1) in packed rows of at most `budget` tokens
(default 18,432: one sequence per micro-batch), bf16 compute over fp32 master weights, AdamW. One warm-up step
(compilation), then 3 timed steps: tok/s, MFU (bench_engine.train_throughput's FLOP count: 6 x body params x tokens
+ 6 x lm_head x response tokens + causal attention), peak GiB (torch.cuda.max_memory_allocated). An out-of-memory is a
result: it is recorded with the peak and where it happened. Appends one JSON line to OUT/seed.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine
from bench_engine import train_throughput  # the same FLOP count and timing as the 0.5B learner part

SEED_LENGTHS = "2048+14336," * 3 + "2048+14336"


def model_dir(shape: str, tie: str) -> str:
    from rayrl.models import make_model

    target = os.path.join(os.environ.get("RAYRL_CACHE", "/tmp/rayrl-cache"), f"{shape}-{tie}")
    if not os.path.exists(os.path.join(target, "COMPLETE")):
        t0 = time.perf_counter()
        make_model(shape, target, tie={"tied": True, "untied": False}.get(tie),
                   device="cuda" if torch.cuda.is_available() else "cpu")
        print(f"made {target} in {time.perf_counter() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
    return target


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--out", default=".")
    ap.add_argument("--label", default="HEAD")
    ap.add_argument("--lengths", default=SEED_LENGTHS, help="prompt+response,...: other lengths (a CPU smoke run)")
    ap.add_argument("--profile", default="", help="one more step under the profiler: OUT/NAME.json.gz and OUT/NAME")
    args = ap.parse_args()
    lengths = [sum(map(int, x.split("+"))) for x in args.lengths.split(",")]
    prompt = int(args.lengths.split(",")[0].split("+")[0])
    shape, tie, ckpt, kind, *rest = args.case.split(":")
    budget = int(rest[0]) if rest else 18432
    offload = rest[1] if len(rest) > 1 else "-"
    reshard = rest[2] if len(rest) > 2 else "-"
    head = rest[3] if len(rest) > 3 else "fused"
    dead = int(rest[4]) if len(rest) > 4 else 0
    if head == "plain":  # LogprobHead calls the module's hidden_logprobs: the logits first, then the same kernels
        import rayrl.logprobs as lp

        def plain(hidden, weight, targets, temperature=1.0, compiled=False, entropy=False, chunk=lp.LOGPROB_CHUNK):
            f = lp.token_logprobs_entropy if entropy else lp.token_logprobs
            return f(hidden @ weight.t(), targets, temperature, compiled=compiled, chunk=chunk)

        lp.hidden_logprobs = plain
    from rayrl.config import load_config
    from rayrl.learner import Learner

    path = model_dir(shape, tie)
    gpu = int(torch.cuda.is_available())
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"learner.gpus_per_worker={gpu}",
                             "learner.lr=1e-6", "learner.pack=true", f"learner.max_tokens_per_micro_batch={budget}",
                             f"learner.compile={kind == 'compile'}", f"model.gradient_checkpointing={ckpt != 'nockpt'}",
                             f"data.max_prompt_length={prompt}", f"rollout.max_response_length={lengths[0] - prompt}",
                             f"engine.max_model_len={lengths[0]}",
                             f"learner.optimizer_offload={offload == 'optimizer'}",
                             # only when asked: an older rayrl (seed_bench.sh's old=) has neither field
                             *(["model.gradient_checkpointing_keep_attention=true"] if ckpt == "keepattn" else []),
                             *([f"learner.reshard_after_forward={reshard == 'reshard'}"] if reshard != "-" else [])],
                      check_files=False)
    rec = {"case": args.case, "code": args.label, "shape": shape, "tie": tie, "ckpt": ckpt,
           "compile": kind == "compile", "budget": budget, "lengths": lengths, "offload": offload, "reshard": reshard,
           "head": head, "dead": dead}
    try:
        ln = Learner(path, cfg)
        rec["params"] = ln.setup()
        rec["tied_after_setup"] = ln.model.lm_head.weight is ln.model.model.embed_tokens.weight
        bench_engine.OUT = args.out  # where profile_step writes
        rec.update(train_throughput(ln, lengths, prompt, 151_643, profile=args.profile, dead=dead))
    except torch.OutOfMemoryError as e:
        rec.update(error="out of memory", peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                   where=traceback.format_exc().strip().splitlines()[-3:], detail=str(e)[:300])
    except Exception as e:  # noqa: BLE001 - recorded in the case's line
        rec.update(error=repr(e)[:600], where=traceback.format_exc().strip().splitlines()[-6:])
    line = json.dumps(rec, default=str)
    print("SEED " + line, flush=True)
    with open(os.path.join(args.out, "seed.jsonl"), "a") as f:
        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
