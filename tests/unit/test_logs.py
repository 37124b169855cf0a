"""rayrl.logs without Ray: which file an actor writes to, what the driver puts in the job's runtime_env, and that a
redirected process's output (its children's included) lands in the file."""

from __future__ import annotations

import os
import subprocess
import sys

from rayrl.logs import ENV, log_path, runtime_env
from tests.helpers import ROOT


def test_log_path_from_the_actor_name():
    assert log_path("/r/logs", "rayrl/engine/0") == "/r/logs/engine-0.log"
    assert log_path("/r/logs", "rayrl/rollout/3.1") == "/r/logs/rollout-3.1.log"  # a replaced worker's generation
    assert log_path("/r/logs", "rayrl/queue") == "/r/logs/queue.log"
    assert log_path("/r/logs", None) == f"/r/logs/actor-{os.getpid()}.log"


def test_runtime_env_names_an_absolute_log_dir_unless_verbose(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runtime_env("out/x", verbose=False, local=True) == {
        "env_vars": {"RAY_DEDUP_LOGS": "1", ENV: str(tmp_path / "out" / "x" / "logs")}}
    assert runtime_env("/abs/x", verbose=False, local=False) == {"env_vars": {ENV: "/abs/x/logs"}}
    assert runtime_env("out/x", verbose=True, local=True) == {"env_vars": {"RAY_DEDUP_LOGS": "1"}}
    assert runtime_env("out/x", verbose=True, local=False) is None  # a job keeps its own runtime_env as it is


def test_redirect_sends_the_process_and_its_children_to_the_file(tmp_path):
    log = tmp_path / "logs" / "engine-0.log"
    code = ("import os, subprocess, sys\n"
            "from rayrl.logs import redirect\n"
            "print('before')\n"
            f"redirect({str(log)!r})\n"
            "print('to stdout'); print('to stderr', file=sys.stderr); os.write(2, b'raw fd 2\\n')\n"
            "subprocess.run(['sh', '-c', 'echo from a child'], check=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    assert p.stdout == "before\n" and p.stderr == ""
    text = log.read_text()
    assert text.startswith("==== rayrl: pid ")
    for line in ("to stdout", "to stderr", "raw fd 2", "from a child"):
        assert line in text
