"""GPU-only: the vLLM CUDA engine and the nccl FSDP learner on one GPU agree after a weight sync.

Skipped (with this reason) on machines without a CUDA GPU, such as CI's.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped where there is no CUDA GPU (tests/conftest.py)


def test_engine_matches_learner_on_gpu(tiny_model):
    from rayrl.config import load_config
    from rayrl.engine import Engine, Sampling
    from rayrl.learner import Learner
    from rayrl.types import TrainBatch

    cfg = load_config(None, ["engine.gpus_per_engine=1", "learner.gpus_per_worker=1",
                             "engine.gpu_memory_utilization=0.3", "learner.lr=1e-3"], check_files=False)
    learner = Learner(tiny_model, cfg)
    learner.setup()
    engine = Engine(tiny_model, cfg.engine)
    prompt = [5, 17, 33, 2, 90, 41, 7]

    async def go():
        await engine.start()
        learner.train_step(TrainBatch(prompt_ids=[prompt], response_ids=[[11, 12, 13]], loss_mask=[[1, 1, 1]],
                                      advantages=[[1.0] * 3], global_tokens=3, global_seqs=1))
        await engine.receive_weights("object_store", learner.send_weights("object_store", 1), 1)
        return await engine.generate(prompt, Sampling(max_tokens=12, temperature=0.0))

    try:
        gen = asyncio.run(go())
        ref = TrainBatch(prompt_ids=[prompt], response_ids=[gen.token_ids], loss_mask=[[1] * len(gen.token_ids)],
                         advantages=[[0.0] * len(gen.token_ids)], global_tokens=1, global_seqs=1)
        lp = learner.compute_logprobs(ref)[0]
        diff = float(np.max(np.abs(np.array(lp) - np.array(gen.logprobs))))
        print(f"max |engine - learner| logprob: {diff:.2e}")  # noqa: T201 - a figure BENCHMARKS.md reads (pytest -s)
        assert gen.policy_version == 1 and diff < 1e-3  # fp32 on GPU: different kernels (TF32 off), not bit-exact
    finally:
        asyncio.run(engine.shutdown())
        learner.shutdown()
