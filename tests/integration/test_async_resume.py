"""Async RL (algo.max_staleness 2) resumed from a checkpoint written while later steps' tasks were queued (and, with
trainer.async_save, written in the background beside the next rollout): every prompt of the epoch is trained exactly
once, at its own step, and no step trains on weights more than 2 versions older than the learner's, before or after
the resume. Local Ray, CPU vLLM, the tiny random Qwen2."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

from rayrl import checkpoint
from rayrl.config import load_config
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.integration

K, STEPS, BATCH, N = 2, 4, 4, 4


def _metrics(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _events(out: str) -> list[dict]:
    with open(os.path.join(out, "trace", "events.jsonl")) as f:
        return list(map(json.loads, f))


def _trained(out: str) -> dict[int, list[dict]]:
    """Training step (1-based) -> the trajectories collected for it (the trace's trajectory spans' args)."""
    steps = defaultdict(list)
    for rec in _events(out):
        if rec["event"]["cat"] == "trajectory":
            steps[rec["step"]].append(rec["event"]["args"])
    return steps


def _prompts(trajs: list[dict]) -> list[tuple[str, int]]:
    return sorted((t["task_id"], t["prompt_tokens"]) for t in trajs)


def test_resume_in_the_middle_of_an_async_run(tiny_model, ray_cluster, tmp_path):
    from rayrl.train import train

    # one epoch: 16 rows = 4 steps x 4 prompts; checkpoints at steps 2 and 4 (both kept)
    common = {"trainer.total_steps": STEPS, "trainer.batch_size": BATCH, "rollout.n": N, "data.size": STEPS * BATCH,
              "algo.max_staleness": K, "trainer.save_freq": 2, "trainer.trace": True, "trainer.export_hf": False}
    full = str(tmp_path / "full")
    train(load_config(None, tiny_overrides(tiny_model, full, **common,
                                           **{"trainer.async_save": True,
                                              "algo.rollout_correction.rollout_is": "token",
                                              # rejection (nothing is out of these bounds): a proximal forward pass
                                              "algo.rollout_correction.rollout_rs": "token_k1",
                                              "algo.rollout_correction.rollout_rs_threshold": 1e6})))
    mid = os.path.join(full, "checkpoints", "step_2")
    # step 2's checkpoint was committed once its writes ended, in step 3 (after its rollout); step 4's at the end
    writes = {r["event"]["args"]["checkpoint_step"]: r["step"] for r in _events(full)
              if r["event"]["name"] == "checkpoint write"}
    assert writes == {2: 3, 4: 4} and checkpoint.latest(full).endswith("step_4")
    state = checkpoint.load_state(mid)
    assert state["step"] == 2 and state["policy_version"] == 2
    # when step 2 was saved, the tasks of steps 3 and 4 were already queued (dispatched at versions 0 and 1): the
    # resumed run regenerates them from the checkpoint's data position, at its own policy version
    resumed = str(tmp_path / "resumed")
    train(load_config(None, tiny_overrides(tiny_model, resumed, **common, **{  # TIS computed in the loss
        "trainer.resume": mid, "algo.rollout_correction.rollout_is": "token"})))

    before, after = _trained(full), _trained(resumed)
    assert sorted(before) == [1, 2, 3, 4] and sorted(after) == [3, 4]
    trained = {s: before[s] for s in (1, 2)} | after
    count = defaultdict(int)
    for step, trajs in trained.items():
        for tr in trajs:
            assert tr["task_id"].startswith(f"s{step - 1}/")  # trained at its own step
            count[tr["task_id"]] += 1
    # each prompt of the epoch (s<step>/p<index>) with its N samples, exactly once
    assert count == {f"s{s}/p{i}/{k}": 1 for s in range(STEPS) for i in range(BATCH) for k in range(N)}
    # the same prompts as the uninterrupted run's steps 3 and 4 (the data position was restored)
    assert all(_prompts(after[s]) == _prompts(before[s]) for s in (3, 4))
    assert checkpoint.load_state(checkpoint.latest(resumed))["data"] == \
        checkpoint.load_state(checkpoint.latest(full))["data"]

    # staleness: step s trains with the learner at version s - 1 on episodes generated at version >= s - 1 - K
    for run, out in ((before, full), (after, resumed)):
        m = _metrics(out)
        for step, trajs in run.items():
            ages = [step - 1 - t["policy_version"] for t in trajs]
            assert 0 <= min(ages) and max(ages) <= K and m[step]["policy/staleness_max"] == max(ages)
            assert m[step]["groups/trained"] == BATCH  # every collected group was trained
            assert "rollout_corr/k3_kl" in m[step] and "rollout_corr/log_ratio_max" in m[step]
            if out == full:  # rollout_rs needs the proximal log-probs first: a forward pass, counted as learner time
                assert m[step]["time/old_logprob_s"] > 0
                assert m[step]["time/share_learner"] * m[step]["time/step_s"] >= \
                    0.999 * (m[step]["time/learner_s"] + m[step]["time/old_logprob_s"])
            else:  # one update, no rejection: stale episodes too take train_step's own log-probs as the proximal
                assert "time/old_logprob_s" not in m[step]
    assert max(s - 1 - t["policy_version"] for s, ts in before.items() for t in ts) >= 1  # it did run ahead
    # after the resume nothing older than the checkpoint's version 2 was trained: the queued tasks were regenerated
    assert all(t["policy_version"] >= 2 for ts in after.values() for t in ts)
    assert all(_metrics(full)[s]["rollout_corr/rollout_is_mean"] > 0 for s in range(1, STEPS + 1))
    assert all(_metrics(resumed)[s]["rollout_corr/rollout_is_mean"] > 0 for s in (3, 4))
