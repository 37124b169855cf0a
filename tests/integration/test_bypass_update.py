"""algo.rollout_correction.bypass_mode through the driver's update (rayrl.train.update) on a real Learner actor: with
two mini-batches, decoupled mode runs the proximal forward pass first (`time/old_logprob_s`), bypass mode none, and
in both the step's rollout_corr/ metrics compare the engines' log-probs with the learner's."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from rayrl.config import load_config
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("bypass", [False, True])
def test_two_minibatches_with_and_without_bypass(tiny_model, ray_cluster, bypass):
    from rayrl.actors.learner import LearnerActor
    from rayrl.train import update
    from rayrl.types import Trajectory

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "trainer.batch_size": 2, "learner.mini_batch_size": 1, "learner.lr": 1e-2,
        "algo.rollout_correction.bypass_mode": bypass}))
    rng = np.random.default_rng(0)
    # the engines' log-probs of every response token: -2 (the tiny random model's are ~ -5: ratios far from 1)
    groups = [[Trajectory(task_id=f"g{g}/{k}", group_id=f"g{g}", step=0, data_source="x",
                          prompt_ids=rng.integers(5, 200, 6).tolist(), response_ids=rng.integers(5, 200, 4).tolist(),
                          loss_mask=[1] * 4, logprobs=[-2.0] * 4, reward=float(k)) for k in range(2)]
              for g in range(2)]
    ln = LearnerActor.options(num_cpus=1).remote(tiny_model, cfg, 0, 1)
    try:
        addr, port = ray.get(ln.address.remote(), timeout=60)
        ray.get(ln.setup.remote(addr, port), timeout=300)
        m = update(cfg, [ln], groups)
    finally:
        ray.kill(ln)
    assert m["actor/updates"] == 2
    assert ("time/old_logprob_s" in m) is not bypass  # bypass: no proximal forward pass
    assert m["rollout_corr/log_ratio_mean"] < -1.0  # learner below the engines' -2 on these random tokens
    # bypass: PPO's ratio is against the engines' -2, far above the learner's, so every ratio is below 0.8 and the
    # clip takes the tokens of negative advantage: half of them (each group: rewards 0 and 1). Decoupled: against the
    # learner's own log-probs before the step's first update, which one update at lr 1e-2 moves much less
    assert (m["actor/pg_clipfrac"] == pytest.approx(0.5)) is bypass
