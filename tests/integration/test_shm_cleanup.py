"""What an engine leaves behind. Its /dev/shm scratch dir (weight_sync.shm) inside a Ray actor: SIGTERM of the
actor's process removes it; ray.kill (no code runs) leaves it, and the next engine process on the node removes it.
Its shutdown, after a failed start, during the start or after a run: no engine core process and no AsyncLLM left."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from rayrl.weight_sync.shm import ShmDir
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


@ray.remote
class Holder:
    """An async actor like EngineActor that holds a ShmDir (as the vLLM backend does)."""

    def __init__(self, base: str):
        self.shm = ShmDir(base)

    async def where(self) -> tuple[int, str]:
        return os.getpid(), self.shm.path


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_sigterm_of_the_actor_removes_its_dir(tmp_path):
    h = Holder.remote(str(tmp_path))
    pid, path = ray.get(h.where.remote(), timeout=60)
    assert os.path.isdir(path)
    os.kill(pid, signal.SIGTERM)
    assert wait_until(lambda: not os.path.exists(path), timeout=30), os.listdir(tmp_path)


def test_ray_kill_leaves_it_for_the_next_one(tmp_path):
    h = Holder.remote(str(tmp_path))
    _, path = ray.get(h.where.remote(), timeout=60)
    ray.kill(h, no_restart=True)
    wait_until(lambda: _dead(h), timeout=30)
    nxt = Holder.remote(str(tmp_path))
    _, new = ray.get(nxt.where.remote(), timeout=60)
    assert not os.path.exists(path) and os.listdir(tmp_path) == [os.path.basename(new)]
    ray.kill(nxt, no_restart=True)


def _dead(h) -> bool:
    try:
        ray.get(h.where.remote(), timeout=5)
        return False
    except ray.exceptions.RayActorError:
        return True


def test_engine_whose_start_failed_shuts_down_cleanly(tmp_path):
    """A vLLM engine whose start raised (here: model.path is not a model; on the H200, a test's time-out inside
    vLLM's start) shuts down without an AttributeError of its own hiding that error, and removes its dir."""
    import asyncio

    from rayrl.config import EngineConfig
    from rayrl.engine import Engine

    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    engine = Engine(str(not_a_model), EngineConfig())

    async def go():
        with pytest.raises(Exception) as failed:
            await engine.start()
        path = engine._backend.shm.path
        await engine.shutdown()
        return failed.value, path

    err, path = asyncio.run(go())
    assert not isinstance(err, AttributeError) and not os.path.exists(path)


def test_engine_shut_down_while_vllm_starts_leaves_no_engine_core(tiny_model):
    """shutdown() while AsyncLLM is still being built (its engine core spawned, the start not done) kills that engine
    core and ends the start; before, shutdown found no AsyncLLM yet and left the engine core running (a Ctrl-C during
    a run's start orphaned it). Needs no Ray: the Engine class as EngineActor runs it."""
    import asyncio

    import psutil

    from rayrl.config import EngineConfig
    from rayrl.engine import Engine

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    engine = Engine(tiny_model, EngineConfig())

    async def go():
        start = asyncio.ensure_future(engine.start())
        spawned: list[psutil.Process] = []
        for _ in range(1200):  # the engine core process appears well before vLLM is ready
            spawned = [p for p in me.children(recursive=True) if p.pid not in before]
            if spawned or start.done():
                break
            await asyncio.sleep(0.1)
        assert spawned and not start.done(), "vLLM started before its engine core could be seen"
        await engine.shutdown()
        with pytest.raises(Exception) as ended:  # vLLM's own error for an engine core that died
            await asyncio.wait_for(start, 60)
        return spawned, ended.value

    spawned, ended = asyncio.run(go())
    assert not isinstance(ended, asyncio.TimeoutError), "the start went on after shutdown()"
    left = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline()) for p in left]


def test_engine_shut_down_leaves_no_asyncllm_for_the_exit(tiny_model):
    """After shutdown() no vLLM AsyncLLM is left, not even as uncollected garbage (it sits in reference cycles), in
    the process that held the Engine: one left for the interpreter's exit ran its __del__ on torn-down modules, a
    TypeError and once a segfault of the CI's pytest after every test had passed."""
    import asyncio
    import gc

    from vllm.v1.engine.async_llm import AsyncLLM

    from rayrl.config import EngineConfig
    from rayrl.engine import Engine, Sampling

    async def go():
        engine = Engine(tiny_model, EngineConfig(max_model_len=256))
        await engine.start()
        try:
            return await engine.generate([1, 2, 3], Sampling(max_tokens=4))
        finally:
            await engine.shutdown()

    assert len(asyncio.run(go()).token_ids) >= 1
    # no gc.collect() here: the exit's own collection comes after the modules are cleared
    alive = [o for o in gc.get_objects() if isinstance(o, AsyncLLM)]
    assert not alive, f"{len(alive)} AsyncLLM left after shutdown()"
