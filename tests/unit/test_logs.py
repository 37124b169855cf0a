"""rayrl.logs without Ray: which file an actor writes to, what the driver puts in the job's runtime_env, and that a
redirected process's output (its children's included) lands in the file; the one line an actor's error becomes (Ray's
own error classes, built as Ray builds them on the driver)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import ray
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayTaskError

from rayrl.logs import ENV, failure, log_path, runtime_env
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


def task_error(repr_: str | None, exc: Exception, ip: str = "10.9.9.9") -> RayTaskError:
    """What ray.get raises on the driver when an actor method raised `exc` (RayTaskError(<its class>))."""
    tb = ('Traceback (most recent call last):\n  File "probe.py", line 9, in fail\n'
          + "".join(traceback.format_exception_only(exc)))
    return RayTaskError("fail", tb, exc, proctitle="ray::Probe.fail", pid=7, ip=ip, actor_repr=repr_,
                        actor_id="ab12").as_instanceof_cause()


def test_failure_of_an_actor_method_names_the_actor_its_last_line_and_its_log():
    e = task_error("rayrl/engine/0, log: /r/logs/engine-0.log", ValueError("bad weights\nmore detail"))
    here = ray.util.get_node_ip_address()
    assert failure(e, "/r/logs") == "engine/0 failed: ValueError: bad weights (log: /r/logs/engine-0.log on 10.9.9.9)"
    e = task_error("rayrl/engine/0, log: /r/logs/engine-0.log", KeyError("w"), ip=here)  # this node: no ip
    assert failure(e, "/r/logs") == "engine/0 failed: KeyError: 'w' (log: /r/logs/engine-0.log)"
    assert failure(task_error("rayrl/engine/0", ValueError("x"), ip=here), None) == "engine/0 failed: ValueError: x"


def test_failure_found_inside_the_driver_s_own_exceptions():
    inner = task_error("rayrl/learner/1, log: /r/logs/learner-1.log", RuntimeError("NCCL timeout"))
    try:
        try:
            raise inner
        except RayTaskError as e:
            raise SystemError("wrapped") from e
    except SystemError as outer:
        line = failure(outer, "/r/logs")
    assert line.startswith("learner/1 failed: RuntimeError: NCCL timeout (log: /r/logs/learner-1.log")


def test_failure_of_a_dead_actor_names_the_log_from_its_name():
    ctx = ActorDiedErrorContext(class_name="Engine", actor_id=bytes(16), pid=33, name="rayrl/rollout/2.1",
                                ray_namespace="ns", node_ip_address=ray.util.get_node_ip_address(),
                                error_message="The actor is dead because its worker process has died.")
    assert failure(ActorDiedError(ctx), "/r/logs") == (
        "rollout/2.1 failed: The actor is dead because its worker process has died. (log: /r/logs/rollout-2.1.log)")
    unnamed = ActorDiedErrorContext(class_name="Engine", actor_id=bytes(16), error_message="killed")
    assert failure(ActorDiedError(unnamed), "/r/logs") == "Engine failed: killed"  # no name: no log file to point at


def test_no_actor_behind_the_error_is_none():
    assert failure(ValueError("x"), "/r/logs") is None
    assert failure(task_error(None, ValueError("in a plain task")), "/r/logs") is None
