"""A checkpoint save with trainer.async_save against a plain one (the peer), in the same run: how long the learner
is held by `save()`, and what a train step taken while the write runs costs against one taken alone. A third row is
DCP's async_save with its default stager (the copy into pageable memory inside the call: rayrl's async_save before
it copied from a thread into pinned buffers).

The real `rayrl.learner.Learner` (one rank, gloo, this process) over SmolLM2-135M (fp32 master weights + AdamW: 12
bytes a parameter, ~2 GB a checkpoint), a train step of 4 sequences x 128 tokens. Each round: a plain save; a step
alone; a background save, a step while its write runs, then `written()`. Best round of `--rounds` reported (the
first round warms the page cache and DCP's planner).

    python bench/async_save.py            # out: /tmp/rayrl-async-save (removed after each save)
    python bench/async_save.py --gpu      # the learner on the GPU (bf16 compute, fp32 master weights)
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import time

from rayrl.config import load_config
from rayrl.models import resolve_model
from rayrl.types import TrainBatch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/rayrl-async-save")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gpu", action="store_true", help="the learner on the GPU")
    a = ap.parse_args()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rayrl.learner import Learner

    gpu = ["learner.gpus_per_worker=1", "model.dtype=bfloat16"] if a.gpu else []
    cfg = load_config(None, ["trainer.async_save=true", "learner.micro_batch_size=2", *gpu], check_files=False)
    ln = Learner(resolve_model(a.model), cfg)
    n_params = ln.setup()
    half = a.tokens // 2
    batch = TrainBatch(prompt_ids=[[(7 * i + j) % 1000 + 1 for j in range(half)] for i in range(a.seqs)],
                       response_ids=[[(11 * i + j) % 1000 + 1 for j in range(a.tokens - half)] for i in range(a.seqs)],
                       loss_mask=[[1] * (a.tokens - half)] * a.seqs, advantages=[[1.0] * (a.tokens - half)] * a.seqs,
                       global_tokens=a.seqs * (a.tokens - half), global_seqs=a.seqs)
    ln.train_step(batch)  # the optimizer state exists from here (a checkpoint's full size)

    def fresh(name: str) -> str:
        d = os.path.join(a.out, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def timed(f) -> float:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    def dcp_default(d: str) -> None:  # DCP's async_save with its own stager: the copy happens inside the call
        ln.written()
        model_sd, optim_sd = get_state_dict(ln.model, ln.optim)
        ln._writing = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(d, "learner"),
                                     process_group=ln._save_group)

    def background(save) -> tuple[float, float, float]:
        """(held, the step beside the write, the write done after) s."""
        held = timed(save)
        t0 = time.perf_counter()
        beside = timed(lambda: ln.train_step(batch))
        ln.written()
        return held, beside, time.perf_counter() - t0 + held

    rows = []
    for rnd in range(a.rounds + 1):
        plain = timed(lambda: ln.save(fresh("plain")))
        alone = timed(lambda: ln.train_step(batch))
        old = background(lambda: dcp_default(fresh("default")))
        new = background(lambda: ln.save(fresh("background"), background=True))
        if rnd:  # round 0: warm-up
            rows.append((plain, alone, old, new))
        print(f"round {rnd}{' (warm-up)' if not rnd else ''}: plain save {plain:.2f} s, step alone {alone:.2f} s | "
              + " | ".join(f"{name}: held {h:.2f} s, step beside the write {b:.2f} s, written after {w:.2f} s"
                           for name, (h, b, w) in (("DCP's stager", old), ("rayrl", new))))
    shutil.rmtree(a.out, ignore_errors=True)
    plain, alone, old, new = min(rows, key=lambda r: r[0] + r[3][0])
    where = "GPU" if a.gpu else f"{os.cpu_count()} cores"
    print(f"\n{datetime.date.today()}  {n_params / 1e6:.0f}M parameters, {where}, best of {a.rounds}")
    print("| save | learner held s | vs plain | train step s | write done after s |")
    print("|---|---|---|---|---|")
    print(f"| plain (peer) | {plain:.2f} | 1.00x | {alone:.2f} (after it) | {plain:.2f} |")
    for name, (held, beside, whole) in (("async_save, DCP's default stager (copy in the call)", old),
                                        ("trainer.async_save (copy in a thread)", new)):
        print(f"| {name} | {held:.2f} | {held / plain:.2f}x | {beside:.2f} (beside the write: "
              f"{beside / alone:.2f}x alone) | {whole:.2f} |")
    ln.shutdown()


if __name__ == "__main__":
    main()
