"""Quiet by default: actors' and engines' own output goes to output_dir/logs/<role>-<i>.log, not to the console; an
actor that fails is one `rayrl:` line naming it, its error and its log; `--verbose` (trainer.verbose) puts everything on
the console; Ray's own warnings stay off it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, tiny_overrides

pytestmark = pytest.mark.integration

# An actor wrapped like rayrl's shells: it prints, a C-level write goes to fd 2, a child process prints, then it fails;
# the driver runs under the CLI's run_driver, as `rayrl train` does.
PROBE = """
import os, subprocess, sys, ray
from rayrl import cluster
from rayrl.cli import run_driver
from rayrl.config import load_config
from rayrl.logs import to_file

class Probe:
    def __init__(self):
        print("PROBE-STDOUT", flush=True)
        os.write(2, b"PROBE-FD2\\n")
        subprocess.run(["sh", "-c", "echo PROBE-CHILD"], check=True)

    def fail(self):
        raise ValueError("PROBE-BOOM")

def driver(cfg):
    cluster.connect(cfg)
    try:
        p = ray.remote(to_file(Probe)).options(name="rayrl/probe/0").remote()
        ray.get(p.fail.remote(), timeout=120)
    finally:
        ray.shutdown()

cfg = load_config(None, ["trainer.ray_num_cpus=2", "trainer.output_dir=" + sys.argv[1], *sys.argv[2:]],
                  check_files=False)
sys.exit(run_driver(driver, cfg))
"""

# Lines of Ray's own (its C++ core's log lines, its warnings) that must not reach the default console.
RAY_NOISE = re.compile(r"max_restarts|constructor arguments|core_worker|\.cc:\d+|\(raylet\)|WARNING|Unhandled error|"
                       r"Traceback|ActorDiedError|RayTaskError")


def ray_noise(console: str) -> list[str]:
    return [ln for ln in console.splitlines() if RAY_NOISE.search(ln) and not ln.startswith("rayrl: ")]


def run_probe(out: Path, *overrides: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", PROBE, str(out), *overrides], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_actor_output_goes_to_its_log_and_its_error_is_one_line_naming_it(tmp_path):
    rc, console = run_probe(tmp_path / "run")
    log = tmp_path / "run" / "logs" / "probe-0.log"
    text = log.read_text()
    for line in ("PROBE-STDOUT", "PROBE-FD2", "PROBE-CHILD"):
        assert line in text, text
    assert "PROBE-STDOUT" not in console and "PROBE-FD2" not in console and "PROBE-CHILD" not in console, console
    assert rc == 1, console
    assert f"rayrl: probe/0 failed: ValueError: PROBE-BOOM (log: {log})" in console.splitlines(), console
    assert not ray_noise(console), console


def test_verbose_leaves_actor_output_on_the_console(tmp_path):
    rc, console = run_probe(tmp_path / "run", "trainer.verbose=true")
    assert "PROBE-STDOUT" in console and "PROBE-CHILD" in console, console
    assert rc == 1 and "rayrl: probe/0 failed: ValueError: PROBE-BOOM" in console.splitlines(), console
    assert "Traceback" in console  # verbose: the driver's traceback too
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
             if any(s in ln for s in ("vllm", "vLLM", "EngineCore", "pid=", "(Engine", "(Learner", "(raylet)"))
] + ray_noise(console)
    assert not noisy, noisy
    logs = out / "logs"
    names = {f.name for f in logs.iterdir()}
    assert {"engine-0.log", "learner-0.log", "reward-0.log", "queue.log", "gateway-0.log", "rollout-0.log"} <= names
    assert "vllm" in (logs / "engine-0.log").read_text().lower()


def test_killed_learner_is_one_line_naming_its_log(tiny_model, tmp_path):
    """SIGKILL the learner of a `rayrl train` run after its first step: the run stops (exit 1) with one `rayrl:` line
    naming the learner and its log file, which exists; no traceback, no line of Ray's."""
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    args = tiny_overrides(tiny_model, str(out), **{"trainer.total_steps": 3})
    p = subprocess.Popen(["rayrl", "train", os.path.join(ROOT, "jobs/quickstart.yaml"), *args], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 420
        while not any("step 1: reward" in ln for ln in lines) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any("step 1: reward" in ln for ln in lines), "".join(lines)[-3000:]
        log = out / "logs" / "learner-0.log"
        pid = int(re.match(r"==== rayrl: pid (\d+) ", log.read_text()).group(1))  # to_file's first line
        os.kill(pid, signal.SIGKILL)
        rc = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=30)
    console = "".join(lines)
    assert rc == 1, console[-3000:]
    # rayrl.recovery.LearnerLost: the rank, when (a step's update, or the offload or sync after it, wherever the kill
    # lands), what a rerun resumes from, and the rank's log
    failed = [ln for ln in console.splitlines() if ln.startswith("rayrl: learner/0 died during ")]
    assert len(failed) == 1 and failed[0].endswith(f"(log: {log})"), console[-3000:]
    assert log.is_file()
    assert not ray_noise(console), console[-3000:]
