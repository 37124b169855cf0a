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


@pytest.mark.parametrize("overrides,beside", [
    ([], False),  # the default job: CPU learners
    (["learner.gpus_per_worker=1"], True),  # compile None: on for GPU learners
    (["learner.gpus_per_worker=1", "learner.compile=false"], False),
    (["learner.gpus_per_worker=1", "learner.param_offload=true"], False),
    (["learner.gpus_per_worker=0.5", "engine.gpus_per_engine=0.5", "engine.sleep_level=1"], False),
])
def test_learner_warm_up_runs_beside_the_first_rollout_only_where_it_keeps_its_gpu(overrides, beside):
    from rayrl.colocate import warm_up_beside_rollout

    assert warm_up_beside_rollout(load_config(None, overrides, check_files=False)) is beside


@pytest.mark.parametrize("job", ["retool_qwen3_4b_1gpu.yaml", "retool_qwen3_4b_e2b.yaml"])
def test_seed_jobs_with_sleeping_engines_do_not_warm_up_beside_the_rollout(job):
    from rayrl.colocate import warm_up_beside_rollout

    assert not warm_up_beside_rollout(load_config(os.path.join(ROOT, "jobs", job), [], check_files=False))


def qwen25_7b_shapes() -> list[tuple[int, ...]]:
    """Qwen2.5-7B's parameter shapes (untied lm_head, q/k/v biases): 7.62B parameters."""
    h, inter, kv, vocab = 3584, 18944, 512, 152064
    layer = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return [(vocab, h), *layer * 28, (h,), (vocab, h)]


H200_HOST = {"Alive": True, "NodeManagerAddress": "10.0.0.7",
             "Resources": {"GPU": 1.0, "memory": 100e9, "object_store_memory": 34e9}}  # 125 GiB as Ray splits it
ONE_GPU = ["engine.gpus_per_engine=0.5", "learner.gpus_per_worker=0.5", "model.dtype=bfloat16"]


@pytest.mark.parametrize("overrides, warned", [
    # the one-GPU seed layout on the 7B shape: state 61 GB + parameters 58 GB (rounded) + engine weights 29 GB
    (["engine.sleep_level=1", "learner.param_offload=true", "learner.optimizer_offload=true"], True),
    # the AdamW state alone, packed (61 GB), and the engine dropping its weights: fits
    (["engine.sleep_level=2", "learner.optimizer_offload=true"], False),
    (["engine.sleep_level=1", "learner.optimizer_offload=true"], False),  # + 29 GB: 90 of 134 GB
    # + a background checkpoint's staged copy, 12 bytes a parameter (91 GB): 181 of 134 GB
    (["engine.sleep_level=1", "learner.optimizer_offload=true", "trainer.async_save=true"], True),
])
def test_host_memory_warning_on_the_7b_shape_on_one_h200_host(overrides, warned):
    from rayrl.colocate import host_memory_warning

    cfg = load_config(None, ONE_GPU + overrides, check_files=False)
    warning = host_memory_warning(cfg, qwen25_7b_shapes(), [H200_HOST])
    assert (warning is not None) == warned
    if warned:
        assert "node 10.0.0.7" in warning and "learner.optimizer_offload ~60.9 GB" in warning
    if "learner.param_offload=true" in overrides:
        assert "learner.param_offload ~57.9 GB" in warning and "engine.sleep_level=2" in warning
    if "trainer.async_save=true" in overrides:
        assert "trainer.async_save ~91.4 GB" in warning


def test_host_memory_is_per_rank_shard_and_skips_nodes_without_gpus():
    from rayrl.colocate import host_memory_warning

    def eight_gpus(memory: float) -> dict:
        return {"Alive": True, "NodeManagerAddress": "10.0.0.8",
                "Resources": {"GPU": 8.0, "memory": memory, "object_store_memory": 0.2 * memory}}

    cpu_only = {"Alive": True, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 64.0, "memory": 1e9}}
    cfg = load_config(None, ONE_GPU + ["engine.num_engines=8", "learner.num_workers=8", "engine.sleep_level=1",
                                       "learner.param_offload=true", "learner.optimizer_offload=true"],
                      check_files=False)
    # 8 ranks, each with 1/8 of the state (7.6 GB) and of the parameters (7.2 GB rounded), and 8 engines' whole
    # weights (29 GB rounded each): ~351 GB on the node; the CPU-only node holds none of it
    assert host_memory_warning(cfg, qwen25_7b_shapes(), [eight_gpus(1.5e12), cpu_only]) is None
    warning = host_memory_warning(cfg, qwen25_7b_shapes(), [eight_gpus(300e9), cpu_only])
    assert "node 10.0.0.8 (8 learner rank(s), 8 engine(s))" in warning and "~351 GB" in warning


def test_host_memory_not_estimated_without_offload_or_sleep():
    from rayrl.colocate import host_memory_warning

    cfg = load_config(None, ONE_GPU, check_files=False)  # nothing waits in CPU memory, however small the node
    tiny = {**H200_HOST, "Resources": {"GPU": 1.0, "memory": 1e6, "object_store_memory": 0.0}}
    assert host_memory_warning(cfg, qwen25_7b_shapes(), [tiny]) is None
