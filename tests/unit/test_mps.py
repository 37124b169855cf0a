"""placement.mps: the MPS control daemon of a node (rayrl.mps.MpsDaemon) against a stand-in of NVIDIA's control
program (tests/standins: no GPU here), and the config check before anything starts."""

from __future__ import annotations

import os

import pytest

from rayrl import mps
from rayrl.config import ConfigError, load_config
from tests.helpers import ROOT

STANDINS = os.path.join(ROOT, "tests", "standins")


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv("PATH", STANDINS + os.pathsep + os.environ["PATH"])


def _commands(pipe_dir: str) -> list[str]:
    with open(f"{pipe_dir}/log/control.log") as f:
        return f.read().split()


def test_the_daemon_answers_on_the_runs_own_pipe_and_quits_when_stopped(standin, tmp_path):
    d = mps.MpsDaemon(str(tmp_path / "m"))
    assert d.alive()
    assert d.env == {"CUDA_MPS_PIPE_DIRECTORY": f"{tmp_path}/m/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{tmp_path}/m/log"}
    assert d.command("get_server_list") is not None
    assert _commands(str(tmp_path / "m")) == ["get_server_list"] * 2  # the start's readiness probe, then ours
    assert d.stop() == 0  # the stand-in exits 0 on `quit` only
    assert not d.alive()
    assert not (tmp_path / "m").exists()  # the run's folder goes with it
    with pytest.raises(RuntimeError, match="get_server_list"):  # nobody answers on that pipe any more
        d.command("get_server_list")


def test_the_clients_are_the_processes_its_servers_serve(standin, monkeypatch, tmp_path):
    d = mps.MpsDaemon(str(tmp_path / "none"))
    assert d.clients() == (d.node, [])  # no process here touches a GPU: no server started
    d.stop()
    monkeypatch.setenv("STANDIN_MPS_CLIENTS", "101 102")
    d = mps.MpsDaemon(str(tmp_path / "two"))
    assert d.clients() == (d.node, [101, 102])
    d.stop()


def test_a_daemon_that_had_to_be_killed_leaves_its_logs(standin, monkeypatch, tmp_path):
    monkeypatch.setenv("STANDIN_MPS_DEAF", "1")
    d = mps.MpsDaemon(str(tmp_path / "m"), timeout=2)
    assert d.stop() == -9  # `quit` answered, not obeyed: killed after the timeout
    assert _commands(str(tmp_path / "m"))[-1] == "quit"


def test_a_node_without_the_control_program_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"placement.mps: nvidia-cuda-mps-control is not on PATH on node \S+"):
        mps.MpsDaemon(str(tmp_path / "m"))


def test_a_daemon_that_fails_at_once_says_what_it_printed(standin, monkeypatch, tmp_path):
    monkeypatch.setenv("STANDIN_MPS_FAIL", "1")
    with pytest.raises(RuntimeError, match="exited with 3: An instance of this daemon is already running"):
        mps.MpsDaemon(str(tmp_path / "m"), timeout=10)


def test_mps_needs_processes_that_share_a_gpu():
    with pytest.raises(ConfigError, match="placement.mps=true needs processes that share a GPU"):
        load_config(None, ["placement.mps=true"])  # the default job: CPU engine and learner
    cfg = load_config(None, ["placement.mps=true", "engine.backend=vllm", "engine.gpus_per_engine=0.4",
                             "learner.gpus_per_worker=0.5"])
    assert cfg.placement.mps
