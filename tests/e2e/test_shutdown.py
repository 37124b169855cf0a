"""Clean shutdown: a driver killed with SIGKILL mid-step leaves no rayrl actor, no engine-core subprocess,
no reward pool process (the seed's `pkill -9 -f ray::WorkerDict` must never be needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, LocalCluster, alive, run_processes, tiny_overrides, wait_until

pytestmark = pytest.mark.e2e


def test_sigkill_driver_mid_step_leaves_no_process(tiny_model, tmp_path):
    cluster = LocalCluster().start_head(num_cpus=8)
    try:
        env = {**cluster.env, "RAY_ADDRESS": cluster.address, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
        args = tiny_overrides(tiny_model, str(tmp_path / "run"), **{"trainer.total_steps": 20})
        log = open(tmp_path / "driver.log", "w")
        driver = subprocess.Popen([sys.executable, "-m", "rayrl.train", *args], env=env, cwd=tmp_path,
                                  stdout=log, stderr=subprocess.STDOUT)
        seen: dict[int, tuple[float, str]] = {}

        def step_done():
            seen.update(run_processes(cluster))
            return "step 1:" in (tmp_path / "driver.log").read_text() or driver.poll() is not None

        assert wait_until(step_done, timeout=400, interval=1.0), (tmp_path / "driver.log").read_text()[-3000:]
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(1.0)  # now inside step 2
        seen.update(run_processes(cluster))
        titles = " | ".join(t for _, t in seen.values())
        assert "EngineCore" in titles and "ray::" in titles, titles
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        t0 = time.monotonic()
        wait_until(lambda: not alive(seen), timeout=30)
        left = alive(seen)
        assert not left, f"still running {time.monotonic() - t0:.0f}s after SIGKILL: {left}"
    finally:
        cluster.stop()
