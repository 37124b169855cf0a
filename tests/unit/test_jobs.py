"""Every job file in jobs/ loads and validates (files and model folders are not checked: they live elsewhere)."""

from __future__ import annotations

import glob
import os

import pytest

from rayrl.agents.tool_agent import load_tools
from rayrl.config import load_config

JOBS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "*.yaml")))


def test_there_are_jobs() -> None:
    assert any(j.endswith("retool_tiny.yaml") for j in JOBS)


@pytest.mark.parametrize("path", JOBS, ids=[os.path.basename(j) for j in JOBS])
def test_job_loads(path: str) -> None:
    cfg = load_config(path, check_files=False)
    if cfg.rollout.agent == "rayrl.agents.tool_agent:agent":  # its agent_config is checked by the agent itself
        load_tools(cfg.rollout.agent_config.get("tools"))
