"""rayrl's SFT driver: cold-start supervised fine-tuning on the RL run's own learner actors (FSDP2, same placement).
`rayrl sft JOB.yaml [section.key=value ...]`, or `python -m rayrl.sft ...` (what `ray job submit` runs).

The rows (sft.train_file; rayrl.sft_data) are multi-turn conversations in verl's multi-turn SFT layout, tokenized with
the chat template the RL Gateway will render (model.chat_template) exactly as the Gateway records an episode, and all
checked before any actor starts. One step: the next sft.batch_size conversations -> equal shards per learner rank ->
`Learner.sft_step` at the step's learning rate (packed token-budget micro-batches, -log p token-mean over the
assistant's tokens of the whole batch) -> log -> validation loss every trainer.test_freq steps -> checkpoint every
trainer.save_freq. At the end the model goes to output_dir/hf with the tokenizer and the chat template it was trained
with, the folder an RL job's model.path can name. How it departs from verl's SFT trainer:
- the trained tokens are what the engine samples after the Gateway's generation prompt, through the end-of-turn token
  (not the template's newline after it), and the tokens between turns are what the Gateway inserts at RL time;
- a batch that runs past the end of an epoch is completed from the next epoch's order (verl drops the last one);
- the learning rate is set by the driver each step: warmup and cosine as verl's get_cosine_schedule_with_warmup.
"""

from __future__ import annotations

import math
import random
import sys
import time

import ray

from rayrl import checkpoint, cluster, stop, templates
from rayrl.batching import shard
from rayrl.config import Config, ConfigError
from rayrl.data import DataIterator
from rayrl.metrics import StepLogger
from rayrl.models import param_count, resolve_model
from rayrl.sft_data import Example, load_examples
from rayrl.types import TrainBatch


def sft(cfg: Config) -> dict:
    """Run the SFT job; returns a summary (final step, checkpoint, HF folder, last metrics)."""
    t, s = cfg.trainer, cfg.sft
    model_path = resolve_model(cfg.model.path)
    tok = templates.tokenizer(model_path, cfg.model.chat_template)
    rows = load_examples(s.train_file, tok, s.max_length, s.truncation)  # a bad row stops here: no actor started
    val_rows = load_examples(s.val_file, tok, s.max_length, s.truncation) if s.val_file else []
    total = s.max_steps or s.epochs * math.ceil(len(rows) / s.batch_size)
    data = DataIterator(rows, s.batch_size, t.seed, cfg.data.shuffle)
    n_params = param_count(model_path)
    checkpoint.preflight(t.output_dir, n_params, cfg.model.dtype, t.export_hf)  # a save that cannot fit fails now
    cluster.connect(cfg)
    check_cluster(cfg, ray.cluster_resources())
    actors, log, summary, step = None, None, {}, 0
    try:
        actors = cluster.start_learners(cfg, model_path)
        step = resume(cfg, actors.learners, data)
        log = StepLogger(t.output_dir, t.logger, total, step, cfg.to_dict(), t.experiment_name, t.project_name)
        log.info(f"sft: {len(rows)} conversations ({sum(e.num_tokens for e in rows)} tokens), {total} steps of "
                 f"{s.batch_size}" + (f", {len(val_rows)} for validation" if val_rows else ""))
        if val_rows and t.val_before_train and step == 0:
            log.log(0, {"sft/val_loss": val_loss(cfg, actors.learners, val_rows)})
        while step < total:
            t0 = time.perf_counter()
            lr = lr_at(step, total, cfg)
            batch = data.next_batch()
            m = sft_step(cfg, actors.learners, batch, lr)
            step += 1
            if val_rows and ((t.test_freq and step % t.test_freq == 0) or step == total):
                m["sft/val_loss"] = val_loss(cfg, actors.learners, val_rows)
            if (t.save_freq and step % t.save_freq == 0) or step == total:
                summary["checkpoint"] = save(cfg, actors.learners, step, data.state())
            m.update({"sft/epoch": step * s.batch_size / len(rows), "time/step_s": time.perf_counter() - t0})
            log.log(step, m)
            summary.update(step=step, metrics=m)
        if t.export_hf:
            hf_dir = f"{t.output_dir}/hf"
            ray.get([ln.export_hf.remote(hf_dir) for ln in actors.learners], timeout=cfg.learner.timeout)
            summary["hf"] = hf_dir
        log.info(f"done: {summary.get('step', step)} steps. checkpoint: {summary.get('checkpoint', '-')}  "
                 f"Hugging Face model: {summary.get('hf', '-')}")
    except BaseException as e:  # SIGTERM / Ctrl-C (rayrl.stop): the caller says where the run stopped
        if (stopped := stop.found(e)) is None:
            raise
        stopped.step = step
        raise stopped from None
    finally:
        if log is not None:
            log.close()
        cluster.shutdown(actors)
    return summary


def shards(cfg: Config, rows: list[Example], world: int) -> list[TrainBatch]:
    """`rows` over the learner ranks (rayrl.batching.shard: equal counts, balanced tokens, masked padding rows)."""
    return shard([rows], [[0.0] * len(e.response_ids) for e in rows], world, cfg.learner.sequence_parallel)


def sft_step(cfg: Config, learners: list, rows: list[Example], lr: float) -> dict[str, float]:
    t0 = time.perf_counter()
    stats = ray.get([ln.sft_step.remote(b, lr) for ln, b in zip(learners, shards(cfg, rows, len(learners)),
                                                                  strict=True)], timeout=cfg.learner.timeout)
    learner_s = max(st.seconds for st in stats)
    return {"sft/loss": sum(st.loss for st in stats), "sft/lr": lr, "sft/grad_norm": stats[0].grad_norm,
            "sft/loss_tokens": sum(sum(e.loss_mask) for e in rows), "time/learner_s": learner_s,
            # every token the learners forwarded, per second of the step's learner calls
            "sft/tokens_per_s": sum(e.num_tokens for e in rows) / max(time.perf_counter() - t0, 1e-9)}


def val_loss(cfg: Config, learners: list, rows: list[Example]) -> float:
    """The SFT loss (token-mean over the assistant's tokens) of every validation conversation, batch by batch."""
    total = tokens = 0.0
    for i in range(0, len(rows), cfg.sft.batch_size):
        chunk = rows[i: i + cfg.sft.batch_size]
        n = sum(sum(e.loss_mask) for e in chunk)
        loss = sum(ray.get([ln.sft_loss.remote(b) for ln, b in zip(learners, shards(cfg, chunk, len(learners)),
                                                                     strict=True)], timeout=cfg.learner.timeout))
        total, tokens = total + loss * n, tokens + n
    return total / max(tokens, 1)


def lr_at(step: int, total: int, cfg: Config) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total`: verl's get_cosine_schedule_with_warmup
    (zero_indexed_step=False: step k warms up to (k+1)/warmup), or its warmup then constant."""
    s, peak = cfg.sft, cfg.learner.lr
    k = step + 1
    if k < s.lr_warmup_steps:
        return peak * k / s.lr_warmup_steps
    if s.lr_schedule == "constant":
        return peak
    progress = (k - s.lr_warmup_steps) / max(1, total - s.lr_warmup_steps)
    return peak * max(s.min_lr_ratio, (1 - s.min_lr_ratio) * 0.5 * math.cos(math.pi * progress)
                      + (1 + s.min_lr_ratio) * 0.5)


def resume(cfg: Config, learners: list, data: DataIterator) -> int:
    """The step to start from: 0 for a new run, or the checkpoint's (weights, optimizer, RNG and data position)."""
    t = cfg.trainer
    ckpt = None if t.resume == "disable" else (checkpoint.latest(t.output_dir) if t.resume == "auto" else t.resume)
    if ckpt is None:
        return 0
    state = checkpoint.load_state(ckpt)
    ray.get([ln.load.remote(ckpt) for ln in learners], timeout=cfg.learner.timeout)
    data.load_state(state["data"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python_rng"]))
    print(f"rayrl: resumed from {ckpt} (step {state['step']})", file=sys.stderr)  # noqa: T201
    return state["step"]


def save(cfg: Config, learners: list, step: int, data_state: dict) -> str:
    tmp = checkpoint.begin(cfg.trainer.output_dir, step)
    ray.get([ln.save.remote(tmp) for ln in learners], timeout=cfg.learner.timeout)
    return checkpoint.commit(tmp, step, {"step": step, "policy_version": step, "data": data_state,
                                         "python_rng": random.getstate(),
                                         "model_path": checkpoint.base_model(cfg.model.path),
                                         "chat_template": cfg.model.chat_template, "dtype": cfg.model.dtype})


def check_cluster(cfg: Config, resources: dict[str, float]) -> None:
    """The learner ranks' GPUs against the cluster's (a rank takes a whole GPU: cluster.start_learners)."""
    lc = cfg.learner
    want = lc.num_workers * math.ceil(lc.gpus_per_worker)
    if want > resources.get("GPU", 0.0):
        raise ConfigError(f"learner.num_workers x learner.gpus_per_worker (rounded up to whole GPUs for sft) = {want} "
                          f"GPUs, but the cluster has {resources.get('GPU', 0.0):g}")


if __name__ == "__main__":
    from rayrl.cli import main as cli_main

    sys.exit(cli_main(["sft", *sys.argv[1:]]))
