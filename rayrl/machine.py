"""The kind of machine the default job runs on. The embedded defaults (rayrl/config.py) are a CPU job; where
`nvidia-smi -L` lists a GPU (the test scripts/install.sh makes to pick the CUDA builds; RAYRL_DEVICE=cpu|cuda decides
for both) `rayrl train` without a job file puts its vLLM engine and FSDP2 learner on the first GPU together: the
layout bench/gpu/train_gpu.sh ran on the H200."""

from __future__ import annotations

import os
import subprocess

from rayrl.config import ConfigError

# the default job's overrides on a GPU machine; the user's own come after them and win
GPU_LAYOUT = ("model.dtype=bfloat16", "engine.gpus_per_engine=0.4", "engine.gpu_memory_utilization=0.3",
              "engine.enforce_eager=false", "learner.gpus_per_worker=0.5")


def kind() -> str:
    """"cuda" or "cpu"."""
    forced = os.environ.get("RAYRL_DEVICE", "")
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ConfigError(f"RAYRL_DEVICE={forced!r}: must be cpu or cuda")
        return forced
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "cuda" if any(line.startswith("GPU ") for line in out.splitlines()) else "cpu"
