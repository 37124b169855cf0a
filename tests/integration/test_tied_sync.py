"""Tied embeddings end to end on CPU: a tiny Qwen3-shaped model whose lm_head is its embedding (as Qwen3-0.6B/1.7B/4B
and Qwen2.5-0.5B), FSDP learners, a real CPU vLLM engine, and the object_store and broadcast weight syncs (cuda_ipc:
tests/gpu/test_gpu_weight_sync.py)."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from rayrl import weight_sync

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 33, 2, 90, 41, 7]


@pytest.mark.parametrize(("strategy", "ranks"), [("object_store", 1), ("broadcast", 2)])
def test_tied_model_engine_matches_learner_after_two_updates(tied_model, ray_cluster, strategy, ranks):
    """After each of two steps (lr 1e-2: every weight moves, the log-probs visibly) and a sync, the engine's greedy
    log-probs equal the learner's within 1e-4. The learner sends the shared tensor once, as the embedding; vLLM's CPU
    build computes the logits from a packed copy of it in the lm_head, which a reload alone leaves at the first
    weights (weight_sync.worker.retie packs it again)."""
    from rayrl.actors.engine import EngineActor
    from rayrl.actors.learner import LearnerActor
    from rayrl.config import load_config
    from rayrl.engine import Sampling
    from rayrl.types import TrainBatch
    from tests.helpers import tiny_overrides

    cfg = load_config(None, tiny_overrides(tied_model, "/tmp/unused", **{
        "engine.weight_sync": strategy, "engine.sync_bucket_mb": 1, "engine.sync_timeout": 120, "learner.lr": 1e-2}))
    engine = EngineActor.options(num_cpus=1, max_concurrency=100).remote(tied_model, cfg.engine, cfg.model.dtype, 0,
                                                                          "engine/0")
    learners = [LearnerActor.options(num_cpus=1).remote(tied_model, cfg, r, ranks) for r in range(ranks)]
    greedy = Sampling(max_tokens=12, temperature=0.0)

    def batch(response, adv, n=1):  # every rank gets the same sequence: its share of an n-sequence mini-batch
        return TrainBatch(prompt_ids=[PROMPT], response_ids=[response], loss_mask=[[1] * len(response)],
                          advantages=[[adv] * len(response)], global_tokens=len(response) * n, global_seqs=n)

    def learner_logprobs(response):  # FSDP: every rank takes part
        return ray.get([ln.compute_logprobs.remote(batch(response, 0.0)) for ln in learners], timeout=120)[0][0]

    try:
        addr, port = ray.get(learners[0].address.remote(), timeout=60)
        ray.get([engine.start.remote()] + [ln.setup.remote(addr, port) for ln in learners], timeout=600)
        assert weight_sync.connect(cfg, learners, [engine]) == strategy
        g0 = ray.get(engine.generate.remote(PROMPT, greedy), timeout=120)
        assert np.allclose(learner_logprobs(g0.token_ids), g0.logprobs, atol=1e-4)  # the same start
        for version in (1, 2):
            before = learner_logprobs([11, 12, 13, 14])
            ray.get([ln.train_step.remote(batch([11, 12, 13, 14], 1.0, ranks)) for ln in learners], timeout=120)
            moved = np.abs(np.array(learner_logprobs([11, 12, 13, 14])) - before).max()
            assert moved > 0.1, moved  # the update is large, not a rounding-level change
            weight_sync.push(strategy, learners, [engine], version, cfg.engine.sync_timeout)
            g1 = ray.get(engine.generate.remote(PROMPT, greedy), timeout=120)
            assert g1.policy_version == version
            lp = learner_logprobs(g1.token_ids)
            diff = float(np.abs(np.array(lp) - np.array(g1.logprobs)).max())
            assert diff < 1e-4, (version, diff, lp, g1.logprobs)
            assert g1.logprobs != g0.logprobs  # the update reached the engine
            g0 = g1
    finally:
        ray.get([engine.shutdown.remote()] + [ln.shutdown.remote() for ln in learners], timeout=60)
        for a in [engine, *learners]:
            ray.kill(a)
