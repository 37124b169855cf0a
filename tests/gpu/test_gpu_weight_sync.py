"""GPU-only: the cuda_ipc weight sync (engine on learner rank 0's GPU) and, with two GPUs, auto -> broadcast over
nccl. After each sync the vLLM CUDA engine's logprobs equal the learner's.

Skipped (with this reason) on machines without a CUDA GPU, such as CI's.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped where there is no CUDA GPU (tests/conftest.py)

PROMPT = [5, 17, 33, 2, 90, 41, 7]


def _batch(response, adv=1.0):
    from rayrl.types import TrainBatch

    return TrainBatch(prompt_ids=[PROMPT], response_ids=[response], loss_mask=[[1] * len(response)],
                      advantages=[[adv] * len(response)], global_tokens=len(response), global_seqs=1)


def _cfg(mode: str):
    from rayrl.config import load_config

    return load_config(None, ["engine.gpus_per_engine=1", "learner.gpus_per_worker=1",
                              "engine.gpu_memory_utilization=0.3", "learner.lr=1e-3", f"engine.weight_sync={mode}"],
                       check_files=False)


@pytest.mark.parametrize("model", ["tiny_model", "tied_model"])
def test_cuda_ipc_sync_matches_learner(model, request):
    """Two steps, each followed by a cuda_ipc sync: the learner's buffer is allocated once (same id both times),
    the engine opened it once, and after each sync the engine's greedy logprobs match the learner's. The tied model
    (a Qwen3 shape whose lm_head is the embedding) sends the shared tensor once, so the direct copies apply too."""
    from rayrl.engine import Engine, Sampling
    from rayrl.learner import Learner

    cfg = _cfg("cuda_ipc")
    path = request.getfixturevalue(model)
    learner = Learner(path, cfg)
    learner.setup()
    engine = Engine(path, cfg.engine)
    greedy = Sampling(max_tokens=12, temperature=0.0)

    async def go():
        await engine.start()
        out = [await engine.generate(PROMPT, greedy)]
        for version in (1, 2):
            learner.train_step(_batch([11, 12, 13]))
            handle = learner.send_weights("cuda_ipc", version)
            await engine.receive_weights("cuda_ipc", handle, version)
            gen = await engine.generate(PROMPT, greedy)
            # the learner's logprobs of the same tokens now, before its next step
            out.append((handle.buffer_id, gen, learner.compute_logprobs(_batch(gen.token_ids, 0.0))[0]))
            loads.append(engine._receivers["cuda_ipc"].loads)
        return out

    loads = []
    try:
        g0, (id1, g1, lp1), (id2, g2, lp2) = asyncio.run(go())
        assert id1 == id2 == engine._receivers["cuda_ipc"].opened  # persistent buffer, opened once in the worker
        # the first sync runs vLLM's load_weights and checks its direct copies; the second replays them
        assert loads == [["load_weights"], ["direct_copies"]], loads
        for version, before, gen, lp in ((1, g0, g1, lp1), (2, g1, g2, lp2)):
            diff = float(np.max(np.abs(np.array(lp) - np.array(gen.logprobs))))
            print(f"cuda_ipc v{version}: max |engine - learner| logprob {diff:.2e}")  # noqa: T201 - pytest -s figure
            assert gen.policy_version == version and diff < 1e-3  # fp32 on GPU: different kernels, not bit-exact
            assert gen.logprobs != before.logprobs  # the sync reached the engine
    finally:
        asyncio.run(engine.shutdown())
        learner.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (engine and learner on different GPUs)")
def test_auto_picks_broadcast_on_two_gpus_and_matches(tiny_model, ray_cluster):
    import ray

    from rayrl import weight_sync
    from rayrl.actors.engine import EngineActor
    from rayrl.actors.learner import LearnerActor
    from rayrl.engine import Sampling

    cfg = _cfg("auto")
    engine = EngineActor.options(num_gpus=1, max_concurrency=100).remote(tiny_model, cfg.engine, "float32", 0,
                                                                         "engine/0")
    learner = LearnerActor.options(num_gpus=1).remote(tiny_model, cfg, 0, 1)
    greedy = Sampling(max_tokens=12, temperature=0.0)
    try:
        ray.get([engine.start.remote(), learner.setup.remote()], timeout=600)
        mode = weight_sync.connect(cfg, [learner], [engine])
        assert mode == "broadcast"
        g0 = ray.get(engine.generate.remote(PROMPT, greedy), timeout=120)
        ray.get(learner.train_step.remote(_batch([11, 12, 13])), timeout=120)
        weight_sync.push(mode, [learner], [engine], 1, cfg.engine.sync_timeout)
        g1 = ray.get(engine.generate.remote(PROMPT, greedy), timeout=120)
        lp = ray.get(learner.compute_logprobs.remote(_batch(g1.token_ids, 0.0)), timeout=120)[0]
        diff = float(np.max(np.abs(np.array(lp) - np.array(g1.logprobs))))
        print(f"broadcast (nccl): max |engine - learner| logprob {diff:.2e}")  # noqa: T201 - pytest -s figure
        assert g1.policy_version == 1 and diff < 1e-3 and g1.logprobs != g0.logprobs
    finally:
        ray.get([engine.shutdown.remote(), learner.shutdown.remote()], timeout=60)
        ray.kill(engine)
        ray.kill(learner)
