"""placement.mps on a local Ray that declares a GPU it does not have, with a stand-in of NVIDIA's MPS control program
(tests/standins): a daemon on the node of the colocated engines and learner, up before them; an actor given the
client environment reaches it; shutdown stops it after them."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import ray

from rayrl import cluster
from rayrl.config import load_config
from tests.helpers import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def one_gpu():
    path = os.path.join(ROOT, "tests", "standins") + os.pathsep + os.environ["PATH"]
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, namespace="rayrl-test-mps",
             runtime_env={"env_vars": {"PATH": path, "PYTHONPATH": ROOT}})
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Client:
    def ask(self) -> tuple[str | None, int]:
        """What a CUDA process would use to join MPS, and whether the daemon answers there."""
        out = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", capture_output=True, text=True)
        return os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), out.returncode


def test_a_daemon_per_node_serves_the_engines_and_learners_and_stops_after_them(one_gpu):
    cfg = load_config(None, ["placement.mps=true", "engine.backend=vllm", "engine.num_engines=2",
                             "engine.gpus_per_engine=0.2", "learner.gpus_per_worker=0.5"])
    groups = cluster.reserve(cfg)
    daemons, client = cluster.start_mps(cfg, groups)
    assert len(daemons) == 1  # one node
    pipe = client["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith("/tmp/rayrl-mps-") and os.path.exists(f"{pipe}/control")  # the stand-in's socket
    # an engine's options: its GPU bundle and the client environment
    probe = Client.options(**cluster.engine_placement(cfg, groups, 0), **cluster._env(extra=client)).remote()
    assert ray.get(probe.ask.remote(), timeout=60) == (pipe, 0)
    outsider = Client.options(**cluster._env()).remote()  # no client environment: the host's default pipe, no daemon
    assert ray.get(outsider.ask.remote(), timeout=60) == (None, 1)
    actors = cluster.Actors(queue=None, reward=None, engines=[probe], mps=daemons, groups=groups)
    # no CUDA process here: none joined, and the warning names the node
    assert cluster.mps_unjoined(actors) == [
        f"rayrl: placement.mps: no engine or learner joined the MPS daemon on node {socket.gethostname()}; they share "
        "its GPU in time slices, as without MPS"]
    cluster.shutdown(actors)
    assert not os.path.exists(os.path.dirname(pipe))  # quit (the stand-in exits 0 on `quit` only): folder removed
