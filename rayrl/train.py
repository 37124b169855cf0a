"""rayrl's driver: GRPO where every part is a Ray actor. `python -m rayrl.train [job.yaml] [section.key=value ...]`

One step: put the step's tasks in the TaskQueue (batch_size prompts x rollout.n samples) -> rollout
workers lease them and run the agent against the engines -> collect whole groups -> GRPO advantages
(verl) -> learner update (FSDP2) -> push the weights to the engines -> policy version + 1 -> log ->
checkpoint. How it departs from textbook GRPO:
- losses are token-mean over the whole mini-batch with DAPO's clip-higher (clip_ratio_low/high);
- old log-probs are recomputed by the learner, except with one mini-batch, one epoch and no rollout
  rejection (stale episodes too) where old = current.detach() exactly;
- `algo.rollout_correction` (verl's, off by default): truncated importance weights and rejection against the engines'
  log-probs, PPO's ratio against the recomputed ones (decoupled PPO); the rollout_corr/ mismatch metrics every step;
- failed trajectories are never trained on and groups with < 2 successes are dropped (rayrl.batching);
- `algo.max_staleness: k` lets the queue hold up to k steps of tasks ahead of the learner (async RL);
  0 is synchronous: rollout is idle while the learner trains.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import ray

from rayrl import checkpoint, cluster, colocate, logs, recovery, stop, trace
from rayrl.batching import advantages, rollout_correction, shard, trainable_groups
from rayrl.config import Config, check_cluster, staleness_warning
from rayrl.data import DataIterator, load_rows
from rayrl.metrics import (
    StepLogger,
    dashboard,
    phase_shares,
    summarize,
    tool_metrics,
    val_generations,
    val_metrics,
    version_metrics,
)
from rayrl.models import param_shapes, resolve_model
from rayrl.types import Task, Trajectory


def train(cfg: Config) -> dict:
    """Run the job; returns a summary (final step, checkpoint, HF folder, last metrics)."""
    t, d = cfg.trainer, cfg.data
    # first: a bad row is a one-line DataError naming the file and row, and nothing has started (no model converted)
    rows = load_rows(d.source, d.size, t.seed, d.gym_kwargs, d.system_prompt)
    val_rows = [row for src in d.val_source or [] for row in load_rows(src, d.val_size, t.seed + 1, d.gym_kwargs,
                                                                      d.system_prompt)]
    model_path = resolve_model(cfg.model.path)
    data = DataIterator(rows, t.batch_size, t.seed, d.shuffle)
    shapes = param_shapes(model_path)  # from its config (meta device): what the checks below need to know
    n_params = sum(math.prod(s) for s in shapes)
    checkpoint.preflight(t.output_dir, n_params, cfg.model.dtype, t.export_hf)  # a save that cannot fit fails now
    cluster.connect(cfg)
    check_cluster(cfg, ray.cluster_resources())
    for warning in (colocate.host_memory_warning(cfg, shapes, ray.nodes()), staleness_warning(cfg)):
        if warning:
            print(warning, file=sys.stderr)  # noqa: T201
    decode = _decoder(model_path) if val_rows and t.log_val_generations else None
    actors, log, summary, step = None, None, {}, 0
    writing: Checkpoint | None = None  # trainer.async_save: a checkpoint the learners still write
    if t.trace:
        trace.start(t.output_dir)
    try:
        with trace.span("start actors"):
            actors = cluster.start(cfg, model_path)
            for line in cluster.mps_unjoined(actors):
                print(line, file=sys.stderr)  # noqa: T201
            step, version = resume(cfg, actors, data)
            # a resumed run's weights reach the engines (sleeping engines wake with them; learners offload)
            colocate.to_rollout(cfg, actors, lambda: sync_weights(cfg, actors, version) if step else 0.0)
            if colocate.warm_up_beside_rollout(cfg):
                for ln in actors.learners:  # learner.compile compiles beside the first rollout (Learner.warm_up),
                    ln.warm_up.remote()     # not in the first step; the first train_step queues behind it
        log = StepLogger(t.output_dir, t.logger, t.total_steps, step, cfg.to_dict(), t.experiment_name,
                         t.project_name)
        feeder = Feeder(cfg, actors.queue, data, start=step)
        if val_rows and t.val_before_train and step == 0:
            log.log(0, validate(cfg, actors, val_rows, version, 0, log, decode))
        saved_at = time.monotonic()  # trainer.save_interval_s counts from here
        while step < t.total_steps:
            with trace.step(step + 1):  # one span in the trace holding this step's phases and trajectories
                val: dict[str, float] = {}
                t0, w0 = time.perf_counter(), time.time()
                with trace.span("rollout"):
                    feeder.fill(until=min(step + cfg.algo.max_staleness, t.total_steps - 1), version=version)
                    trajs = collect(cfg, actors, feeder.expected.pop(step), step, feeder.early, feeder)
                trace.trajectories(trajs)
                check_failures(trajs, step + 1, log)
                t_rollout = time.perf_counter() - t0
                groups, dropped = trainable_groups(trajs)
                if writing is not None:  # written beside this rollout: the latest checkpoint from here on
                    summary["checkpoint"], writing = writing.commit(), None
                colo = colocate.to_training(cfg, actors)  # sleeping engines free the GPU for the update
                with recovery.learners_kept(actors.learners, f"step {step + 1}'s update", t.output_dir):
                    learn = update(cfg, actors.learners, groups)
                version, step = version + 1, step + 1
                since = time.monotonic() - saved_at
                saving = checkpoint.due(step, t.total_steps, t.save_freq, t.save_interval_s, since)
                here = feeder.state_before(step)
                if saving:  # learners resident
                    writing = save(cfg, actors, step, version, here, background=t.async_save)
                    if not t.async_save:
                        summary["checkpoint"], writing = writing.commit(), None
                    saved_at = time.monotonic()
                # the engines serve the new policy from here on (sleeping ones awake, learners offloaded); an engine
                # lost in the sync stops the run after a checkpoint of this step (rayrl.recovery.sync): the one being
                # written is committed, one already committed is enough, else one is made then
                lost = (writing.commit if writing is not None else None if saving
                        else functools.partial(save_now, cfg, actors, step, version, here))
                sync = functools.partial(sync_weights, cfg, actors, version, lost)
                colo.update(colocate.to_rollout(cfg, actors, sync))
                sync_s = colo.pop("sync/seconds")
                if val_rows and t.test_freq and step % t.test_freq == 0:
                    v0 = time.perf_counter()
                    val = validate(cfg, actors, val_rows, version, step, log, decode)
                    val["time/val_s"] = time.perf_counter() - v0  # inside time/step_s
                if writing is not None and step == t.total_steps:  # the last checkpoint, written beside the sync and
                    summary["checkpoint"], writing = writing.commit(), None  # validation: its wait is in the step
                m = step_metrics(trajs, groups, dropped, learn, t_rollout, sync_s, version, time.perf_counter() - t0)
                learner_s = learn.get("time/learner_s", 0.0) + learn.get("time/old_logprob_s", 0.0)
                m.update(phase_shares(trajs, w0, w0 + t_rollout, learner_s, sync_s, m["time/step_s"]))
                m.update(val)
                m.update(colo)
                log.log(step, m)
                summary.update(step=step, metrics=m)
        if t.export_hf:
            hf_dir = f"{t.output_dir}/hf"
            colocate.to_training(cfg, actors)  # the learners gather the full model on their GPU
            ray.get([ln.export_hf.remote(hf_dir) for ln in actors.learners], timeout=cfg.learner.timeout)
            summary["hf"] = hf_dir
        log.info(f"done: {summary.get('step', step)} steps. checkpoint: {summary.get('checkpoint', '-')}  "
                 f"Hugging Face model: {summary.get('hf', '-')}"
                 + (f"  trace: {t.output_dir}/trace.json" if t.trace else ""))
    except BaseException as e:  # SIGTERM / Ctrl-C (rayrl.stop): the caller says where the run stopped
        if writing is not None:  # a checkpoint still being written is made the latest if its writes end well
            summary["checkpoint"] = writing.commit_or_drop()
        if (stopped := stop.found(e)) is None:
            raise
        stopped.step = step
        raise stopped from None
    finally:
        if log is not None:
            log.close()
        try:  # the trace first: `ray job stop` SIGKILLs a driver that takes longer than RAY_JOB_STOP_WAIT_TIME_S
            summary["trace"] = trace.close()
        finally:
            cluster.shutdown(actors)
    return summary


class Feeder:
    """Puts each step's tasks into the queue (ahead of the learner by up to max_staleness steps), and keeps them until
    they are collected: the ledger a restarted queue is refilled from (rayrl.recovery)."""

    def __init__(self, cfg: Config, queue, data: DataIterator, start: int):
        self.cfg, self.queue, self.data = cfg, queue, data
        self.next_step = start
        self.version = 0  # the policy version the engines serve (as of the last fill)
        self.expected: dict[int, dict[str, Task]] = {}  # step -> its tasks still to collect, by id
        self.early: dict[int, dict[str, Trajectory]] = {}  # results of later steps that arrived early
        self.states: dict[int, dict] = {}  # step -> data position before its batch (for checkpoints)

    def fill(self, until: int, version: int) -> None:
        self.version = version
        while self.next_step <= until:
            s = self.next_step
            self.states[s] = self.data.state()
            tasks = [Task(task_id=f"s{s}/p{i}/{k}", group_id=f"s{s}/p{i}", step=s, messages=row.messages,
                          ground_truth=row.ground_truth, data_source=row.data_source, extra_info=row.extra_info,
                          policy_version=version)
                     for i, row in enumerate(self.data.next_batch()) for k in range(self.cfg.rollout.n)]
            self.expected[s] = {t.task_id: t for t in tasks}
            try:
                ray.get(self.queue.put.remote(tasks), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # the queue died: collect() puts them in its successor (rayrl.recovery)
            self.next_step += 1

    def state_before(self, step: int) -> dict:
        """The data position a run resumed at `step` must start from."""
        return self.states.get(step) or self.data.state()

    def uncollected(self) -> list[Task]:
        """The tasks of later steps filled ahead whose results have not arrived yet."""
        return [t for s, tasks in self.expected.items() for tid, t in tasks.items() if tid not in self.early.get(s, {})]


def collect(cfg: Config, actors, expected: dict[str, Task], step: int, early: dict[int, dict[str, Trajectory]],
            feeder: Feeder | None = None) -> list[Trajectory]:
    """Wait for every trajectory of `step` (failed ones included); replace rollout workers that die; finish the
    restart of the actors Ray restarts (rayrl.recovery: the queue gets every uncollected task back, from `expected`
    and the `feeder`'s later steps). A role that does not come back raises RoleLost, after a checkpoint of the
    `step` steps done."""
    got = early.pop(step, {})
    deadline = time.monotonic() + cfg.trainer.collect_timeout
    try:
        while len(got) < len(expected):
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: {len(got)} of {len(expected)} trajectories after "
                                   f"trainer.collect_timeout={cfg.trainer.collect_timeout}s")
            try:
                batch = ray.get(actors.queue.get_results.remote(len(expected), 2.0, len(expected) - len(got)),
                                timeout=60)
                stats = ray.get(actors.queue.stats.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                batch, stats = [], {}  # the queue died: the watch below sees it restarted, or lost
            trace.received(batch)
            dashboard({f"queue/{k}": v for k, v in stats.items()}, cfg.trainer.experiment_name)
            for tr in batch:  # keyed by task id: a trajectory can never count twice
                (got if tr.step == step else early.setdefault(tr.step, {}))[tr.task_id] = tr
            restarted = actors.watch.poll()
            if restarted:
                todo = [t for tid, t in expected.items() if tid not in got] + (feeder.uncollected() if feeder else [])
                version = feeder.version if feeder else max(t.policy_version for t in expected.values())
                recovery.recover(cfg, actors, restarted, todo, version)
            for name in cluster.restart_dead_workers(actors, cfg):
                log = logs.where(logs.log_dir(cfg.trainer.output_dir, cfg.trainer.verbose), name)
                print(f"rayrl: rollout worker {name.removeprefix('rayrl/')} died; its leases were re-queued and "  # noqa: T201
                      f"it was replaced{log}", file=sys.stderr)
    except recovery.RoleLost:
        done = checkpoint.latest(cfg.trainer.output_dir)
        if feeder is not None and step and not (done and done.endswith(f"step_{step}")):
            save(cfg, actors, step, feeder.version, feeder.state_before(step))  # the learners hold step `step`
        raise
    return list(got.values())


def update(cfg: Config, learners: list, groups: list[list[Trajectory]]) -> dict[str, float]:
    """Advantages, the old (proximal) log-probs and algo.rollout_correction, then ppo_epochs x mini-batches optimizer
    steps on every learner rank. The rollout_corr/ metrics compare the learner's log-probs before the update with the
    engines' every step (with one update: those train_step computed)."""
    if not groups:
        return {}
    mini = cfg.learner.mini_batch_size or cfg.trainer.batch_size
    minibatches = [groups[i : i + mini] for i in range(0, len(groups), mini)]
    sp, corr = cfg.learner.sequence_parallel, cfg.algo.rollout_correction
    shards = [shard(mb, advantages(mb, cfg.algo.norm_adv_by_std_in_grpo), len(learners), sp) for mb in minibatches]
    timeout = cfg.learner.timeout
    # The proximal log-probs are the learner's before the first update. With one optimizer step they are
    # train_step's own forward pass (old = current.detach(), ratio 1), also for stale episodes: a second forward
    # would only repeat it (verl's recompute_old_log_prob=False), and rollout_is's weights come from it in the loss.
    # Rejection (rollout_rs) changes the mini-batch's token counts before the loss, so it needs that forward first.
    # algo.rollout_correction.bypass_mode: the engines' log-probs are the old ones (train_step reads them), no forward.
    one_update = len(minibatches) == 1 and cfg.learner.ppo_epochs == 1 and corr.rollout_rs is None
    no_forward = one_update or corr.bypass_mode
    t_old = time.perf_counter()
    with trace.span("learner/compute_logprobs"):
        olds = None if no_forward else [
            ray.get([ln.compute_logprobs.remote(s) for ln, s in zip(learners, sh, strict=True)], timeout=timeout)
            for sh in shards]
    # verl's timing_s/old_log_prob: a forward pass over the batch that one-update steps do not need
    old_s = {} if olds is None else {"time/old_logprob_s": time.perf_counter() - t_old}
    mismatch = {} if olds is None else rollout_correction(shards, olds, corr, sp)  # sets is_weights / masks
    stats = []
    for epoch in range(cfg.learner.ppo_epochs):
        for j, sh in enumerate(shards):
            with trace.span("learner/train_step", epoch=epoch, minibatch=j):  # forward + backward + optimizer step
                t0 = time.time()
                stats.append(ray.get([ln.train_step.remote(s, None if olds is None else olds[j][r])
                                      for r, (ln, s) in enumerate(zip(learners, sh, strict=True))], timeout=timeout))
                trace.learner([e for st in stats[-1] for e in st.events], t0, time.time())  # a lane per rank
    if olds is None:  # train_step's log-probs of epoch 0 (mini-batch j's after j updates, in bypass mode)
        mismatch = rollout_correction(shards, [[s.logprobs for s in st] for st in stats[: len(shards)]], corr, sp)
    last = stats[-1]
    learner_s = sum(max(s.seconds for s in st) for st in stats)  # the slowest rank of each optimizer step
    return {**mismatch, **old_s,
            "actor/loss": sum(s.loss for s in last), "actor/pg_clipfrac": sum(s.pg_clipfrac for s in last),
            "actor/ppo_kl": sum(s.ppo_kl for s in last), "actor/entropy": sum(s.entropy for s in last),
            "actor/grad_norm": last[0].grad_norm, "actor/updates": len(stats), "time/learner_s": learner_s,
            # every token a train_step forwarded (prompts and responses, all epochs) per second of train_step
            "learner/tokens_per_s": cfg.learner.ppo_epochs * sum(len(t.prompt_ids) + len(t.response_ids)
                                                                 for g in groups for t in g) / max(learner_s, 1e-9)}


def sync_weights(cfg: Config, actors, version: int, before_lost=None) -> float:
    """The learners' weights -> every engine, by the strategy resolved at start (object_store, cuda_ipc or
    broadcast: rayrl/weight_sync/); an engine that dies meanwhile is restarted and synced (rayrl.recovery.sync).
    Returns the seconds until the slowest engine serves them."""
    t0 = time.perf_counter()
    with trace.span("weight_sync", version=version, strategy=actors.weight_sync):
        recovery.sync(cfg, actors, version, before_lost)
    return time.perf_counter() - t0


def resume(cfg: Config, actors, data: DataIterator) -> tuple[int, int]:
    """(step, policy version) to start from: 0 for a new run, or the checkpoint's (loaded into the learners; the
    caller pushes them to the engines)."""
    t = cfg.trainer
    ckpt = None if t.resume == "disable" else (checkpoint.latest(t.output_dir) if t.resume == "auto" else t.resume)
    if ckpt is None:
        return 0, 0
    state = checkpoint.load_state(ckpt)
    ray.get([ln.load.remote(ckpt) for ln in actors.learners], timeout=cfg.learner.timeout)
    data.load_state(state["data"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python_rng"]))
    print(f"rayrl: resumed from {ckpt} (step {state['step']}, policy version {state['policy_version']})",  # noqa: T201
          file=sys.stderr)
    return state["step"], state["policy_version"]


def save(cfg: Config, actors, step: int, version: int, data_state: dict, background: bool = False) -> Checkpoint:
    """The learners save step `step` (with `background`, trainer.async_save: into CPU memory, written by their
    threads while the run goes on); its `commit()` makes it the latest checkpoint."""
    tmp = checkpoint.begin(cfg.trainer.output_dir, step)
    with trace.span("checkpoint", step=step), recovery.learners_kept(actors.learners, f"the checkpoint of step {step}",
                                                                     cfg.trainer.output_dir):
        ray.get([ln.save.remote(tmp, background) for ln in actors.learners], timeout=cfg.learner.timeout)
    return Checkpoint(cfg, actors, step, tmp, {"step": step, "policy_version": version, "data": data_state,
                                               "python_rng": random.getstate(),
                                               "model_path": checkpoint.base_model(cfg.model.path),
                                               "chat_template": cfg.model.chat_template, "dtype": cfg.model.dtype})


def save_now(cfg: Config, actors, step: int, version: int, data_state: dict) -> str:
    """Step `step`'s checkpoint, the latest once this returns."""
    return save(cfg, actors, step, version, data_state).commit()


@dataclass
class Checkpoint:
    """A checkpoint the learners saved into `tmp`, not yet the latest: `commit()` waits for their background writes
    (none after a plain save) and renames it into place (rayrl.checkpoint.commit)."""

    cfg: Config
    actors: Any
    step: int
    tmp: str
    state: dict
    path: str | None = None  # where it is, once committed

    def commit(self) -> str:
        if self.path is None:
            with trace.span("checkpoint write", checkpoint_step=self.step), recovery.learners_kept(
                    self.actors.learners, f"the checkpoint of step {self.step}", self.cfg.trainer.output_dir):
                ray.get([ln.written.remote() for ln in self.actors.learners], timeout=self.cfg.learner.timeout)
            self.path = checkpoint.commit(self.tmp, self.step, self.state)
        return self.path

    def commit_or_drop(self) -> str | None:
        """On the way out of a stopped or failed run: committed if every write ends well, else left as the temp dir
        the next save removes (the previous checkpoint stays the latest). Never raises."""
        try:
            return self.commit()
        except BaseException as e:  # noqa: BLE001 - a second signal or a lost learner: the run is ending anyway
            why = next(iter(str(e).splitlines()), "") or type(e).__name__
            print(f"rayrl: the checkpoint of step {self.step} was not completed ({why}); the previous one is the "  # noqa: T201
                  "latest", file=sys.stderr)
            return None


def validate(cfg: Config, actors, rows: list, version: int, step: int, log: StepLogger, decode) -> dict[str, float]:
    """`trainer.val_n` samples per validation prompt with the current policy -> verl's val-core/val-aux metrics per
    data source; `trainer.log_val_generations` of them to the logger (`decode`: token ids -> text)."""
    vstep = -1 - version  # negative steps never collide with training steps in the queue
    t = cfg.trainer
    sampling = {k: v for k, v in (("temperature", t.val_temperature), ("top_p", t.val_top_p)) if v is not None}
    tasks = [Task(task_id=f"val{version}/p{i}/{k}", group_id=f"val{version}/p{i}", step=vstep, messages=r.messages,
                  ground_truth=r.ground_truth, data_source=r.data_source, extra_info=r.extra_info,
                  policy_version=version, sampling=sampling)
             for i, r in enumerate(rows) for k in range(cfg.trainer.val_n)]
    with trace.span("validate", version=version):
        ray.get(actors.queue.put.remote(tasks), timeout=60)
        trajs = collect(cfg, actors, {t.task_id: t for t in tasks}, vstep, {})
    trace.trajectories(trajs)
    if decode is not None:
        log.generations(step, val_generations(trajs, t.log_val_generations, decode))
    return val_metrics(trajs)


def _decoder(model_path: str):
    """Token ids -> text as verl logs validation generations (special tokens skipped)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def check_failures(trajs: list[Trajectory], step: int, log: StepLogger) -> None:
    """Say why trajectories failed; stop the run when every one of a step did (a broken agent, reward or gateway
    would otherwise train on nothing for every remaining step)."""
    errors = Counter(t.error for t in trajs if t.error)
    if not errors:
        return
    top, n = errors.most_common(1)[0]
    if sum(errors.values()) == len(trajs):
        raise RuntimeError(f"step {step}: all {len(trajs)} trajectories failed; most common error ({n}x): {top}")
    log.info(f"step {step}: {sum(errors.values())} of {len(trajs)} trajectories failed; most common ({n}x): {top}")


def step_metrics(trajs: list[Trajectory], groups, dropped: int, learn: dict, t_rollout: float, sync_s: float,
                 version: int, step_s: float) -> dict[str, float]:
    ok = [t for t in trajs if t.ok]
    rmean, rstd = summarize([t.reward for t in ok])
    lmean, _ = summarize([sum(t.loss_mask) for t in ok])
    gen_tokens = sum(sum(t.loss_mask) for t in trajs)
    # over the batch's own generation span: an async step's batch may have been generated during earlier steps
    llm = [e for t in trajs for e in t.events if e.get("name") == "llm" and "start" in e and "end" in e]
    gen_s = max(t_rollout, max(e["end"] for e in llm) - min(e["start"] for e in llm) if llm else 0.0)
    spans = [e for t in trajs for e in t.events if e.get("name", "").startswith("sandbox")]
    sandbox = [e["end"] - e["start"] for e in spans]
    runs = [e["args"]["run_s"] for e in spans if "run_s" in e.get("args", {})]
    lags = [t.timings for t in trajs if "loop_lag_mean" in t.timings]  # rayrl.rollout sets mean and max together
    return {"reward/mean": rmean, "reward/std": rstd, "response/length_mean": lmean,
            "rollout/tokens_per_s": gen_tokens / max(gen_s, 1e-9), "time/rollout_s": t_rollout,
            "time/step_s": step_s, "sync/seconds": sync_s, "policy/version": version,
            "trajectories/total": len(trajs), "trajectories/failed": len(trajs) - len(ok),
            "groups/trained": len(groups), "groups/dropped": dropped,
            "policy/staleness_max": max((version - 1 - t.policy_version for t in trajs), default=0),
            "sandbox/latency_s": sum(sandbox) / len(sandbox) if sandbox else 0.0, **tool_metrics(trajs),
            # the run alone (latency_s also holds the wait for a pool slot and the worker's event loop)
            **({"sandbox/run_s": sum(runs) / len(runs)} if runs else {}),
            # how late the rollout workers' event loops woke up while the step's episodes ran (rayrl.rollout)
            **({"rollout/loop_lag_mean_s": sum(g["loop_lag_mean"] for g in lags) / len(lags),
                "rollout/loop_lag_max_s": max(g["loop_lag_max"] for g in lags)}
               if lags else {}),
            **version_metrics(trajs), **learn}


if __name__ == "__main__":
    from rayrl.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
