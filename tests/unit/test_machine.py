"""The default job on a machine with a CUDA GPU: `nvidia-smi -L` decides (as scripts/install.sh does; a stand-in
`nvidia-smi` on PATH here), RAYRL_DEVICE overrides, and the GPU layout is a valid config the user's overrides win
over; a job file keeps its own placement."""

from __future__ import annotations

import os
import stat

import pytest

from rayrl import machine
from rayrl.cli import train_config
from rayrl.config import ConfigError
from tests.helpers import ROOT


def _nvidia_smi(tmp_path, monkeypatch, listing: str, rc: int = 0) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{listing}'\nexit {rc}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("RAYRL_DEVICE", raising=False)


@pytest.mark.parametrize("listing, rc, want", [
    ("GPU 0: NVIDIA H200 (UUID: GPU-4c1e)\\n", 0, "cuda"),
    ("", 0, "cpu"),  # the driver is installed, no GPU
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\\n", 9, "cpu"),
])
def test_kind_follows_nvidia_smi(tmp_path, monkeypatch, listing, rc, want):
    _nvidia_smi(tmp_path, monkeypatch, listing, rc)
    assert machine.kind() == want


def test_rayrl_device_decides_and_is_checked(tmp_path, monkeypatch):
    _nvidia_smi(tmp_path, monkeypatch, "GPU 0: NVIDIA H200\\n")
    monkeypatch.setenv("RAYRL_DEVICE", "cpu")
    assert machine.kind() == "cpu"
    monkeypatch.setenv("RAYRL_DEVICE", "gpu")
    with pytest.raises(ConfigError, match="RAYRL_DEVICE='gpu': must be cpu or cuda"):
        machine.kind()


def test_default_job_on_a_gpu_machine(tmp_path, monkeypatch):
    _nvidia_smi(tmp_path, monkeypatch, "GPU 0: NVIDIA H200\\n")
    cfg, on_gpu = train_config(["trainer.total_steps=2", "engine.gpu_memory_utilization=0.5"])
    assert on_gpu
    assert (cfg.engine.gpus_per_engine, cfg.learner.gpus_per_worker, cfg.model.dtype) == (0.4, 0.5, "bfloat16")
    assert not cfg.engine.enforce_eager and cfg.trainer.total_steps == 2
    assert cfg.engine.gpu_memory_utilization == 0.5  # the user's override wins over the layout

    monkeypatch.setenv("RAYRL_DEVICE", "cpu")
    cfg, on_gpu = train_config([])
    assert not on_gpu and cfg.engine.gpus_per_engine == 0 and cfg.learner.gpus_per_worker == 0


def test_a_job_file_keeps_its_placement(tmp_path, monkeypatch):
    _nvidia_smi(tmp_path, monkeypatch, "GPU 0: NVIDIA H200\\n")
    cfg, on_gpu = train_config([os.path.join(ROOT, "jobs", "quickstart.yaml")])
    assert not on_gpu and cfg.engine.gpus_per_engine == 0
