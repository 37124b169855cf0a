"""runtime_envs/*.yaml are valid runtime_env files, and env vars the user sets in the job's runtime_env win
over rayrl's own per-actor defaults."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import yaml

from rayrl.config import ConfigError, load_config
from tests.helpers import ROOT

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
    """Every actor gets NVLink multicast off and CPU engines/learners every core, unless the job's runtime_env says
    otherwise."""
    import ray

    from rayrl import cluster

    @ray.remote(num_cpus=0)
    class Probe:
        def get(self):
            return {k: os.environ.get(k) for k in ["OMP_NUM_THREADS", *cluster.MULTICAST_OFF]}

    ray.init(num_cpus=2, include_dashboard=False, namespace="rayrl-test-env",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "3", "NCCL_NVLS_ENABLE": "1"}})
    try:  # the job's values are not overridden...
        env = ray.get(Probe.options(**cluster._env(all_cores=True)).remote().get.remote(), timeout=60)
        assert env == {"OMP_NUM_THREADS": "3", "NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}
    finally:
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, namespace="rayrl-test-env")
    try:  # ...and without them, CPU engines and learners get every core, every actor multicast off
        env = ray.get(Probe.options(**cluster._env(all_cores=True)).remote().get.remote(), timeout=60)
        assert env == {"OMP_NUM_THREADS": str(os.cpu_count()), **cluster.MULTICAST_OFF}
        env = ray.get(Probe.options(**cluster._env()).remote().get.remote(), timeout=60)
        assert env == {"OMP_NUM_THREADS": "1", **cluster.MULTICAST_OFF}  # Ray's own default for workers
    finally:
        ray.shutdown()
