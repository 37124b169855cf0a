"""Shared fixtures: a tiny random Qwen2 (built once per session) and a local Ray cluster; every test that starts
neither Ray nor a CLI job (no integration / e2e / gpu / chaos marker) is marked `unit`."""

from __future__ import annotations

import os

import pytest

from tests.helpers import ROOT

NOT_UNIT = ("integration", "e2e", "gpu", "chaos")


def pytest_collection_modifyitems(config, items):
    """Tests are chosen by marker (`pytest -m unit`, `-m "integration or e2e or gpu"`), not by folder; `gpu` tests
    skip themselves, saying so, where there is no CUDA GPU."""
    cuda = None
    for item in items:
        if not any(item.get_closest_marker(m) for m in NOT_UNIT):
            item.add_marker(pytest.mark.unit)
        elif item.get_closest_marker("gpu"):
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU host only)"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from rayrl.models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    """A tiny random Qwen3 with tied embeddings and Qwen's vocabulary (models.make_model "qwen3-tiny", fp32); ~15 s."""
    from rayrl.models import make_model

    return make_model("qwen3-tiny", str(tmp_path_factory.mktemp("models") / "qwen3-tiny"), dtype="float32")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # More CPU slots than cores: actors mostly wait. PYTHONPATH lets workers import tests.helpers.
    ray.init(num_cpus=8, include_dashboard=False, namespace="rayrl-tests",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    yield
    ray.shutdown()
