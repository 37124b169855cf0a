"""The spine end to end on a local Ray with a real CPU vLLM engine and a tiny random Qwen2."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import ray
from safetensors.numpy import load_file

from rayrl import checkpoint
from rayrl.config import load_config
from rayrl.data import DataIterator, load_rows
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.integration


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_steps_then_resume(tiny_model, ray_cluster, tmp_path):
    """Two steps change the parameters and checkpoint each step; a resumed run continues at step 3 and the data
    position is exactly where an uninterrupted run would be."""
    from rayrl.train import train

    out = str(tmp_path / "run")
    cfg = load_config(None, tiny_overrides(tiny_model, out, **{"trainer.save_freq": 1}))
    summary = train(cfg)
    assert summary["step"] == 2
    m = _metrics(out)
    assert [r["step"] for r in m] == [1, 2]
    assert all(r["trajectories/total"] == 16 for r in m)
    assert all(r["actor/entropy"] > 0 for r in m if "actor/loss" in r)  # logged every update (entropy_coeff 0)
    assert not any("time/old_logprob_s" in r for r in m)  # on-policy: train_step's log-probs are the old ones
    assert m[-1]["policy/version"] == 2

    before = load_file(os.path.join(tiny_model, "model.safetensors"))
    after = load_file(os.path.join(out, "hf", "model.safetensors"))
    assert set(before) == set(after)
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, f"only {changed} changed after two steps"

    ck = checkpoint.latest(out)
    assert ck.endswith("step_2") and os.path.exists(os.path.join(ck, "COMPLETE"))
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_1"))  # save_freq=1 kept the previous one

    # resume: 3 steps asked, 2 done -> one more step, numbered 3
    cfg3 = load_config(None, tiny_overrides(tiny_model, out, **{"trainer.save_freq": 1, "trainer.total_steps": 3}))
    assert train(cfg3)["step"] == 3
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]
    state = checkpoint.load_state(checkpoint.latest(out))
    assert state["step"] == 3 and state["policy_version"] == 3
    it = DataIterator(load_rows(cfg.data.source, cfg.data.size, cfg.trainer.seed, cfg.data.gym_kwargs,
                                cfg.data.system_prompt), cfg.trainer.batch_size, cfg.trainer.seed, cfg.data.shuffle)
    for _ in range(3):
        it.next_batch()
    assert state["data"] == it.state()


@pytest.mark.parametrize("mode", ["auto", "broadcast"])
def test_engine_matches_learner_after_sync(tiny_model, ray_cluster, mode):
    """After a training step and a weight sync, the engine's greedy tokens and logprobs equal the learner's.
    Tolerance 1e-4 (both fp32 on CPU; different kernels, so not bit-exact). `auto` is the object store on CPU;
    `broadcast` (gloo here, NCCL on GPUs) goes through the same driver wiring as a run on separate GPUs."""
    from rayrl import cluster
    from rayrl.engine import Sampling
    from rayrl.train import sync_weights
    from rayrl.types import TrainBatch

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{"rollout.num_workers": 1,
                                                                         "engine.weight_sync": mode}))
    actors = cluster.start(cfg, tiny_model)
    try:
        assert actors.weight_sync == ("object_store" if mode == "auto" else mode)
        engine, learner = actors.engines[0], actors.learners[0]
        prompt = [5, 17, 33, 2, 90, 41, 7]
        # a real optimizer step with large lr, so the weights clearly differ from the files the engine loaded
        batch = TrainBatch(prompt_ids=[prompt], response_ids=[[11, 12, 13, 14]], loss_mask=[[1, 1, 1, 1]],
                           advantages=[[1.0] * 4], global_tokens=4, global_seqs=1)
        g0 = ray.get(engine.generate.remote(prompt, Sampling(max_tokens=12, temperature=0.0)), timeout=120)
        ray.get(learner.train_step.remote(batch), timeout=120)
        assert sync_weights(cfg, actors, 1) < 60
        g1 = ray.get(engine.generate.remote(prompt, Sampling(max_tokens=12, temperature=0.0)), timeout=120)
        assert g1.policy_version == 1
        ref = TrainBatch(prompt_ids=[prompt], response_ids=[g1.token_ids], loss_mask=[[1] * len(g1.token_ids)],
                         advantages=[[0.0] * len(g1.token_ids)], global_tokens=1, global_seqs=1)
        cfg_lp = ray.get(learner.compute_logprobs.remote(ref), timeout=120)[0]
        assert np.allclose(cfg_lp, g1.logprobs, atol=1e-4), (cfg_lp, g1.logprobs)
        # the update reached the engine: before the sync the same prompt was scored by the old weights
        assert g0.logprobs != g1.logprobs
    finally:
        cluster.shutdown(actors)


def test_killed_rollout_worker_loses_no_task(tiny_model, ray_cluster):
    """Kill a worker while it holds leases: its tasks are re-queued and finished by its replacement, each once."""
    from rayrl import cluster
    from rayrl.train import Feeder, collect

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "rollout.num_workers": 2, "rollout.agent": "tests.helpers:slow_agent", "rollout.agent_config": "{sleep: 4}",
        "rollout.concurrency": 4}))
    actors = cluster.start(cfg, tiny_model)
    try:
        data = DataIterator(load_rows(cfg.data.source, 50, 0, cfg.data.gym_kwargs, None), cfg.trainer.batch_size, 0)
        feeder = Feeder(cfg, actors.queue, data, start=0)
        feeder.fill(until=0, version=0)
        deadline = time.monotonic() + 60
        while ray.get(actors.queue.stats.remote())["leased"] < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        ray.kill(actors.workers[0], no_restart=True)  # both workers hold 4 leases each, mid-episode
        trajs = collect(cfg, actors, feeder.expected[0], 0, {})
        ids = [t.task_id for t in trajs]
        assert sorted(ids) == sorted(feeder.expected[0]) and len(ids) == len(set(ids)) == 16
        assert all(t.error is None for t in trajs), [t.error for t in trajs if t.error]
        assert {t.worker for t in trajs} >= {"rollout/0.1"}  # the replacement did the killed worker's share
        stats = ray.get(actors.queue.stats.remote())
        assert stats["requeued_total"] >= 4 and stats["duplicates_total"] == 0
    finally:
        cluster.shutdown(actors)


def test_two_gateways_each_serve_their_workers_sessions(tiny_model, ray_cluster):
    """gateway.num_gateways=2: two Gateway actors on their own ports; rollout worker i's episodes go through Gateway
    i % 2 (each records the turns of its workers' sessions), and every task of the step completes."""
    from rayrl import cluster
    from rayrl.train import Feeder, collect

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "rollout.num_workers": 2, "gateway.num_gateways": 2, "rollout.concurrency": 4}))
    actors = cluster.start(cfg, tiny_model)
    try:
        for i in range(2):
            ray.get_actor(f"rayrl/gateway/{i}")  # raises if there is no such actor
        assert len(set(actors.gateway_ports)) == 2
        data = DataIterator(load_rows(cfg.data.source, 50, 0, cfg.data.gym_kwargs, None), cfg.trainer.batch_size, 0)
        feeder = Feeder(cfg, actors.queue, data, start=0)
        feeder.fill(until=0, version=0)
        trajs = collect(cfg, actors, feeder.expected[0], 0, {})
        assert sorted(t.task_id for t in trajs) == sorted(feeder.expected[0])
        assert all(t.error is None for t in trajs), [t.error for t in trajs if t.error]
        per_worker = {w: sum(t.worker == w for t in trajs) for w in ("rollout/0.0", "rollout/1.0")}
        turns = [ray.get(gw.stats.remote(), timeout=30)["recorded_turns"] for gw in actors.gateways]
        assert turns == [per_worker["rollout/0.0"], per_worker["rollout/1.0"]], (turns, per_worker)
        assert all(turns)  # both served
    finally:
        cluster.shutdown(actors)


def test_failed_agent_is_recorded_and_run_goes_on(tiny_model, ray_cluster, tmp_path):
    """An agent that raises yields failed trajectories with the exception text; the step still trains."""
    from rayrl import cluster
    from rayrl.train import Feeder, collect

    cfg = load_config(None, tiny_overrides(tiny_model, str(tmp_path), **{"rollout.agent": "tests.helpers:flaky_agent"}))
    actors = cluster.start(cfg, tiny_model)
    try:
        data = DataIterator(load_rows(cfg.data.source, 50, 0, cfg.data.gym_kwargs, None), cfg.trainer.batch_size, 0)
        feeder = Feeder(cfg, actors.queue, data, start=0)
        feeder.fill(until=0, version=0)
        trajs = collect(cfg, actors, feeder.expected[0], 0, {})
        failed = [t for t in trajs if t.error]
        assert len(failed) == 4 and all(t.error == "RuntimeError: tool crashed" for t in failed)
        assert all(t.reward is not None for t in trajs if not t.error)
    finally:
        cluster.shutdown(actors)


def test_two_fsdp_ranks_equal_one(tiny_model, ray_cluster):
    """The same mini-batch through 2 FSDP ranks (gloo) and through 1 rank gives the same updated weights."""
    from rayrl.actors.learner import LearnerActor
    from rayrl.batching import shard
    from rayrl.types import Trajectory

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{"learner.micro_batch_size": 2}))
    rng = np.random.default_rng(0)
    trajs = [Trajectory(task_id=f"g{g}/{k}", group_id=f"g{g}", step=0, data_source="x",
                        prompt_ids=rng.integers(5, 200, 6).tolist(), response_ids=rng.integers(5, 200, 3 + k).tolist(),
                        loss_mask=[1] * (3 + k), reward=float(k % 2)) for g in range(2) for k in range(3)]
    groups = [trajs[:3], trajs[3:]]
    advs = [[1.0] * 3, [-1.0] * 4, [0.5] * 5, [-0.5] * 3, [1.0] * 4, [-1.0] * 5]

    def run(world: int) -> dict:
        workers = [LearnerActor.options(num_cpus=1).remote(tiny_model, cfg, r, world) for r in range(world)]
        addr, port = ray.get(workers[0].address.remote(), timeout=60)
        ray.get([w.setup.remote(addr, port) for w in workers], timeout=300)
        stats = ray.get([w.train_step.remote(s) for w, s in zip(workers, shard(groups, advs, world), strict=True)],
                        timeout=300)
        packet = ray.get([w.send_weights.remote("object_store", 1, r == 0) for r, w in enumerate(workers)],
                         timeout=300)[0]
        ray.get([w.shutdown.remote() for w in workers], timeout=60)
        for w in workers:
            ray.kill(w)
        return {"loss": sum(s.loss for s in stats), **packet.arrays}

    one, two = run(1), run(2)
    assert abs(one.pop("loss") - two.pop("loss")) < 1e-5
    base = load_file(os.path.join(tiny_model, "model.safetensors"))
    # AdamW's first step moves each weight by ~lr (1e-3); the two runs may differ by float reduction order only.
    # Measured: max difference 1.5e-6. Tolerance 1e-5 = 1% of a step.
    moved = np.mean([np.abs(one[k] - base[k]).mean() for k in one])
    assert moved > 3e-4
    for k in one:
        assert np.abs(one[k] - two[k]).max() < 1e-5, k
