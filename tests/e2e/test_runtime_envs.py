"""runtime_envs/*.yaml are valid runtime_env files, and env vars the user sets in the job's runtime_env win
over rayrl's own per-actor defaults."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import yaml

from rayrl.config import ConfigError, load_config
from tests.conftest import ROOT

FILES = sorted(glob.glob(os.path.join(ROOT, "runtime_envs", "*.yaml")))


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_runtime_env_files_are_valid(path):
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load(Path(path).read_text())
    assert env["working_dir"] == "." and "outputs" in env["excludes"]
    RuntimeEnv(**env)  # Ray's own validation of the fields


def test_gpu_runtime_env_is_seed_001s():
    env = yaml.safe_load(Path(ROOT, "runtime_envs", "gpu.yaml").read_text())
    assert "e2b_code_interpreter" in env["pip"]
    assert env["env_vars"]["LD_LIBRARY_PATH"] == "/usr/local/cuda/compat:${LD_LIBRARY_PATH}"


def test_placement_config():
    cfg = load_config(os.path.join(ROOT, "jobs", "two_nodes.yaml"), ["placement.strategy=SPREAD"], check_files=False)
    assert cfg.placement.rollout_resources == {"worker_node": 0.01} and cfg.placement.strategy == "SPREAD"
    with pytest.raises(ConfigError, match="placement.strategy='ANYWHERE'"):
        load_config(None, ["placement.strategy=ANYWHERE"], check_files=False)


@pytest.mark.integration
def test_user_env_vars_win_over_rayrl_defaults():
    import ray

    from rayrl import cluster

    @ray.remote(num_cpus=0)
    class Probe:
        def get(self):
            return os.environ.get("OMP_NUM_THREADS")

    ray.init(num_cpus=2, include_dashboard=False, namespace="rayrl-test-env",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "3"}})
    try:
        assert cluster._threads(0.0) == {}  # the job's value is not overridden...
        assert ray.get(Probe.options(**cluster._threads(0.0)).remote().get.remote(), timeout=60) == "3"
    finally:
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, namespace="rayrl-test-env")
    try:  # ...and without one, CPU engines and learners get every core
        assert ray.get(Probe.options(**cluster._threads(0.0)).remote().get.remote(), timeout=60) == str(os.cpu_count())
    finally:
        ray.shutdown()
