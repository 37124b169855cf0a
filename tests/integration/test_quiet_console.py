"""Quiet by default: actors' and engines' own output goes to output_dir/logs/<role>-<i>.log, not to the console; an
actor's error reaches the driver naming its log; `--verbose` (trainer.verbose) puts everything on the console."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, tiny_overrides

pytestmark = pytest.mark.integration

# An actor wrapped like rayrl's shells: it prints, a C-level write goes to fd 2, a child process prints, then it fails.
PROBE = """
import os, subprocess, sys, ray
from rayrl import cluster
from rayrl.config import load_config
from rayrl.logs import to_file

class Probe:
    def __init__(self):
        print("PROBE-STDOUT", flush=True)
        os.write(2, b"PROBE-FD2\\n")
        subprocess.run(["sh", "-c", "echo PROBE-CHILD"], check=True)

    def fail(self):
        raise ValueError("PROBE-BOOM")

cluster.connect(load_config(None, ["trainer.ray_num_cpus=2", "trainer.output_dir=" + sys.argv[1], *sys.argv[2:]],
                            check_files=False))
p = ray.remote(to_file(Probe)).options(name="rayrl/probe/0").remote()
try:
    ray.get(p.fail.remote(), timeout=120)
except ray.exceptions.RayTaskError as e:
    print("DRIVER-GOT", str(e).splitlines()[0])
ray.shutdown()
"""


def run_probe(out: Path, *overrides: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", PROBE, str(out), *overrides], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout + p.stderr


def test_actor_output_goes_to_its_log_and_its_error_names_it(tmp_path):
    console = run_probe(tmp_path / "run")
    log = tmp_path / "run" / "logs" / "probe-0.log"
    text = log.read_text()
    for line in ("PROBE-STDOUT", "PROBE-FD2", "PROBE-CHILD"):
        assert line in text, text
    assert "PROBE-STDOUT" not in console and "PROBE-FD2" not in console and "PROBE-CHILD" not in console, console
    got = next(ln for ln in console.splitlines() if ln.startswith("DRIVER-GOT"))
    assert f"rayrl/probe/0, log: {log}" in got, got


def test_verbose_leaves_actor_output_on_the_console(tmp_path):
    console = run_probe(tmp_path / "run", "trainer.verbose=true")
    assert "PROBE-STDOUT" in console and "PROBE-CHILD" in console, console
    assert not (tmp_path / "run" / "logs").exists()


def test_tiny_run_console_has_rayrl_lines_only(tiny_model, tmp_path):
    """`rayrl train` of the default job's code path (tiny model, 1 step): the console has the step line and no
    line of vLLM's, Ray's actors' or the learner's; each role's log file exists and the engine's holds vLLM's lines."""
    out = tmp_path / "quick"
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = tiny_overrides(tiny_model, str(out), **{"trainer.total_steps": 1})
    p = subprocess.run(["rayrl", "train", os.path.join(ROOT, "jobs/quickstart.yaml"), *args], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    console = p.stdout + p.stderr
    assert p.returncode == 0, console[-3000:]
    assert "step 1: reward" in console
    noisy = [ln for ln in console.splitlines()
             if any(s in ln for s in ("vllm", "vLLM", "EngineCore", "pid=", "(Engine", "(Learner", "(raylet)"))]
    assert not noisy, noisy
    logs = out / "logs"
    names = {f.name for f in logs.iterdir()}
    assert {"engine-0.log", "learner-0.log", "reward-0.log", "queue.log", "gateway.log", "rollout-0.log"} <= names
    assert "vllm" in (logs / "engine-0.log").read_text().lower()
