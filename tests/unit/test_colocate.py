"""Taking turns with a shared GPU (engine.sleep_level, learner.param_offload / optimizer_offload): the Engine's
sleep gate (no request lost across a sleep) on the portable hf backend, and the config checks. The memory itself is
measured on the GPU (tests/gpu/test_gpu_colocate.py)."""

from __future__ import annotations

import asyncio
import os

import pytest

from rayrl.config import ConfigError, EngineConfig, load_config
from rayrl.engine import Engine, Sampling
from tests.helpers import ROOT

PROMPT = [5, 17, 33, 2, 90]


def test_request_waits_for_wake_and_is_not_lost(tiny_model):
    engine = Engine(tiny_model, EngineConfig(backend="hf", sync_timeout=10))

    async def go():
        await engine.start()
        awake = await engine.generate(PROMPT, Sampling(max_tokens=4, temperature=0.0))
        await engine.sleep(1)
        assert engine.asleep_tags == {"weights", "kv_cache"}
        waiting = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=4, temperature=0.0)))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # asleep: it waits instead of failing
        await engine.wake_up(["weights"])
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the KV cache still sleeps: requests wait for the whole engine
        await engine.wake_up(["kv_cache"])
        after = await asyncio.wait_for(waiting, 30)
        await engine.shutdown()
        return awake, after

    awake, after = asyncio.run(go())
    assert after.token_ids == awake.token_ids and after.logprobs == pytest.approx(awake.logprobs, abs=1e-5)


def test_sleep_waits_for_requests_in_flight(tiny_model):
    engine = Engine(tiny_model, EngineConfig(backend="hf", sync_timeout=30))

    async def go():
        await engine.start()
        running = asyncio.create_task(engine.generate(PROMPT, Sampling(max_tokens=64, temperature=0.0,
                                                                       ignore_eos=True)))
        await asyncio.sleep(0.05)
        await engine.sleep(2)
        assert running.done() and len(running.result().token_ids) == 64  # finished before the sleep, not cut
        await engine.wake_up()
        assert not engine.asleep_tags
        await engine.shutdown()

    asyncio.run(go())


def test_sleep_times_out_naming_the_engine(tiny_model):
    engine = Engine(tiny_model, EngineConfig(backend="hf", sync_timeout=0.2), name="engine/3")

    async def go():
        await engine.start()
        engine._running["stuck"] = "stuck"  # a request on the backend that never finishes
        with pytest.raises(TimeoutError, match="engine/3: 1 requests still running"):
            await engine.sleep(1)
        engine._running.clear()
        out = await engine.generate(PROMPT, Sampling(max_tokens=2, temperature=0.0))  # still awake: serves
        await engine.shutdown()
        return out

    assert len(asyncio.run(go()).token_ids) == 2


@pytest.mark.parametrize("overrides, message", [
    (["engine.sleep_level=3"], "engine.sleep_level must be 0, 1 or 2"),
    (["engine.sleep_level=1"], "needs engines colocated with the learners"),
    (["engine.sleep_level=1", "engine.gpus_per_engine=1", "learner.gpus_per_worker=1"],
     "needs engines colocated"),
    (["engine.sleep_level=1", "engine.gpus_per_engine=0.5", "learner.gpus_per_worker=0.5", "algo.max_staleness=1"],
     "needs algo.max_staleness=0"),
])
def test_sleep_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, check_files=False)


def test_one_gpu_job_is_colocated_with_sleep_and_offload():
    cfg = load_config(os.path.join(ROOT, "jobs/retool_qwen3_4b_1gpu.yaml"), [], check_files=False)
    assert cfg.engine.sleep_level == 1 and cfg.engine.gpu_memory_utilization >= 0.8
    assert cfg.engine.gpus_per_engine + cfg.learner.gpus_per_worker <= 1
    assert cfg.learner.param_offload and cfg.learner.optimizer_offload
