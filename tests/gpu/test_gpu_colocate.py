"""GPU-only: an engine and a learner taking turns with one GPU (rayrl.colocate's order): the learner's parameters and
AdamW state really leave the GPU and come back with the same training, and a sleeping vLLM engine frees its memory
and serves the learner's new weights after waking. Skipped (with this reason) where there is no CUDA GPU."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped where there is no CUDA GPU (tests/conftest.py)

PROMPT = [5, 17, 33, 2, 90, 41, 7]


def _batch():
    from rayrl.types import TrainBatch

    return TrainBatch(prompt_ids=[PROMPT], response_ids=[[11, 12, 13]], loss_mask=[[1, 1, 1]],
                      advantages=[[1.0] * 3], global_tokens=3, global_seqs=1)


def _learner(model: str, *extra: str):
    from rayrl.config import load_config
    from rayrl.learner import Learner

    cfg = load_config(None, ["learner.gpus_per_worker=1", "learner.lr=1e-3", "learner.compile=false", *extra],
                      check_files=False)
    ln = Learner(model, cfg)
    ln.setup()
    return ln


def test_learner_offload_moves_state_and_trains_the_same(tiny_model):
    import torch

    from rayrl import offload

    plain = _learner(tiny_model)
    plain_losses = [plain.train_step(_batch()).loss for _ in range(3)]
    plain_w = plain.send_weights("object_store", 3).arrays
    plain.shutdown()
    ln = _learner(tiny_model, "learner.param_offload=true", "learner.optimizer_offload=true",
                  "engine.gpus_per_engine=0.5", "learner.gpus_per_worker=0.5", "engine.sleep_level=1")
    losses, copies = [], []
    for _ in range(3):
        stats = ln.train_step(_batch())
        losses.append(stats.loss)
        # FSDP2's state is DTensors: their local shards are what moved
        states = [offload.local(t) for s in ln.optim.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.numel() > 1]
        assert states and all(t.device.type == "cpu" for t in states)  # AdamW state back in CPU memory
        # in the same page-locked copies every step (rayrl.offload.PinnedCopies), not new ones
        assert all(t.is_pinned() for t in states)
        copies.append(sorted(t.data_ptr() for t in states))
        if len(copies) == 1 and hasattr(torch.cuda, "host_memory_stats"):  # before any parameter offload pins more:
            # the pinned bytes are the packed chunks, not each state tensor rounded up to a power of two
            pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
            assert pinned <= ln._optim_cpu.nbytes + (64 << 20), (pinned, ln._optim_cpu.nbytes)
        assert stats.extra["offload/optimizer_to_cuda_s"] > 0
        before = torch.cuda.memory_allocated()
        moved = ln.offload()
        assert moved and all(p.device.type == "cpu" for p in ln.model.parameters())
        assert torch.cuda.memory_allocated() < before - 0.9 * sum(p.numel() * 4 for p in ln.model.parameters())
    w = ln.send_weights("object_store", 3).arrays  # brings the parameters back first
    assert all(p.device.type == "cuda" for p in ln.model.parameters())
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    assert max(float(np.abs(w[k] - plain_w[k]).max()) for k in w) < 1e-6
    assert copies[0] == copies[1] == copies[2]
    ln.shutdown()


def test_sleeping_engine_frees_memory_and_serves_new_weights(tiny_model):
    """Two turns of rayrl.colocate's order with cuda_ipc (as jobs/retool_qwen3_4b_1gpu.yaml): each offload frees the
    parameters' GPU storage and the sync buffer (the sleeping engine closed it after loading; the next sync opens a
    new one), and the woken engine serves the new weights."""
    import torch

    from rayrl.config import load_config
    from rayrl.engine import Engine, Sampling
    from rayrl.types import TrainBatch

    cfg = load_config(None, ["engine.gpus_per_engine=0.5", "learner.gpus_per_worker=0.5", "engine.sleep_level=1",
                             "engine.gpu_memory_utilization=0.4"], check_files=False)
    engine = Engine(tiny_model, cfg.engine)
    ln = _learner(tiny_model, "learner.param_offload=true", "learner.optimizer_offload=true",
                  "engine.gpus_per_engine=0.5", "learner.gpus_per_worker=0.5", "engine.sleep_level=1")
    param_bytes = sum(p.numel() * 4 for p in ln.model.parameters())

    async def go():
        await engine.start()
        free_awake = torch.cuda.mem_get_info()[0]
        await engine.sleep(1)
        free_asleep = torch.cuda.mem_get_info()[0]
        gens, held = [], []
        for version in (1, 2):
            ln.train_step(_batch())
            await engine.wake_up(["weights"])
            await engine.receive_weights("cuda_ipc", ln.send_weights("cuda_ipc", version), version)
            before = torch.cuda.memory_allocated()
            ln.offload()
            held.append((before, torch.cuda.memory_allocated()))
            await engine.wake_up(["kv_cache"])
            gens.append(await engine.generate(PROMPT, Sampling(max_tokens=12, temperature=0.0)))
            await engine.sleep(1)
        await engine.wake_up()
        return free_awake, free_asleep, gens, held

    try:
        free_awake, free_asleep, gens, held = asyncio.run(go())
        freed = (free_asleep - free_awake) / 2**30
        print(f"sleep freed {freed:.1f} GiB; learner bytes before/after each offload {held}")  # noqa: T201
        assert freed > 0.3 * 0.4 * torch.cuda.mem_get_info()[1] / 2**30  # most of its 40% of the card
        # each offload frees the parameters' storage (no view of it kept by the cuda_ipc sender) and the float32 sync
        # buffer of the same size; nothing grows
        assert all(b - a >= 1.9 * param_bytes for b, a in held), (held, param_bytes)
        assert held[1][1] <= held[0][1] + 2**20, held
        gen = gens[-1]
        ref = TrainBatch(prompt_ids=[PROMPT], response_ids=[gen.token_ids], loss_mask=[[1] * len(gen.token_ids)],
                         advantages=[[0.0] * len(gen.token_ids)], global_tokens=1, global_seqs=1)
        lp = ln.compute_logprobs(ref)[0]
        assert gen.policy_version == 2 and float(np.max(np.abs(np.array(lp) - np.array(gen.logprobs)))) < 1e-3
        assert gens[0].logprobs != gens[1].logprobs  # the second sync reached the woken engine
    finally:
        asyncio.run(engine.shutdown())
        ln.shutdown()
