"""An engine's /dev/shm scratch dir (weight_sync.shm) inside a Ray actor: SIGTERM of the actor's process removes it;
ray.kill (no code runs) leaves it, and the next engine process on the node removes it."""

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
