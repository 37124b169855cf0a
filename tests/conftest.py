"""Shared fixtures: a tiny random Qwen2 (built once per session) and a local Ray cluster."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from rayrl.models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # More CPU slots than cores: actors mostly wait. PYTHONPATH lets workers import tests.agents.
    ray.init(num_cpus=8, include_dashboard=False, namespace="rayrl-tests",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    yield
    ray.shutdown()


def tiny_overrides(model: str, out: str, **extra) -> list[str]:
    """A job sized for the tiny model on 2 cores: seconds per step."""
    base = {"model.path": model, "trainer.output_dir": out, "trainer.batch_size": 4, "rollout.n": 4,
            "rollout.max_response_length": 24, "engine.kv_cache_gb": 1, "engine.max_model_len": 512,
            "data.size": 200, "data.max_prompt_length": 128, "learner.lr": 1e-3, "trainer.total_steps": 2,
            # the random model never solves arithmetic: a reward its samples differ on gives GRPO real gradients
            "reward.fn": "tests.helpers_rewards:digit_count", "rollout.temperature": 1.0,
            "gateway.port": 0}  # any free port: tests may run next to a job holding 8001
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
