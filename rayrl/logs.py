"""Where the actors' own output goes. By default (`trainer.verbose: false`) every rayrl actor sends its process's
stdout and stderr, and so those of vLLM, Ray's worker, and every child process (vLLM's EngineCore, the reward pool)
to `<output_dir>/logs/<role>-<i>.log`, and the driver does not stream actor output: the console holds the driver's
lines only (progress, step lines, rayrl's warnings, errors). An actor's error reaches the driver with its log's path
(the actor's repr, which Ray puts in the error). `trainer.verbose: true` (`rayrl train --verbose`) leaves every
actor's output on the console, as Ray streams it.

The driver passes the log folder to every actor in the job's runtime_env (`runtime_env`, used by cluster.connect);
the Ray shells (rayrl/actors/) wrap each class with `to_file`, whose constructor redirects before the class's own.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone

ENV = "RAYRL_LOG_DIR"  # the absolute folder actors write their logs to; unset: output stays where Ray puts it


def runtime_env(output_dir: str, verbose: bool, local: bool) -> dict | None:
    """The job-level runtime_env for ray.init: the log folder (unless verbose), and log dedup on a local cluster."""
    env = {"RAY_DEDUP_LOGS": "1"} if local else {}
    if not verbose:
        env[ENV] = os.path.join(os.path.abspath(output_dir), "logs")
    return {"env_vars": env} if env else None


def log_path(log_dir: str, actor_name: str | None) -> str:
    """`rayrl/engine/0` -> LOG_DIR/engine-0.log; an unnamed actor gets its process id."""
    name = actor_name.removeprefix("rayrl/").replace("/", "-") if actor_name else f"actor-{os.getpid()}"
    return os.path.join(log_dir, f"{name}.log")


def redirect(path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2, so child processes too) appended to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    print(f"==== rayrl: pid {os.getpid()} started {stamp}", flush=True)  # noqa: T201 - into the log file


def to_file(cls: type) -> type:
    """`cls` whose constructor first sends the process's output to its log file when the driver asked for one (ENV),
    and whose repr (in an actor's errors on the driver) names the actor and that file."""

    class Logged(cls):
        def __init__(self, *args, **kwargs):
            import ray

            log_dir = os.environ.get(ENV)
            name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
            self._rayrl_log = log_path(log_dir, name) if log_dir else None
            self._rayrl_name = name or cls.__name__
            if self._rayrl_log:
                redirect(self._rayrl_log)
            super().__init__(*args, **kwargs)

        def __repr__(self) -> str:
            log = getattr(self, "_rayrl_log", None)
            name = getattr(self, "_rayrl_name", cls.__name__)
            return f"{name}, log: {log}" if log else name

    Logged.__name__, Logged.__qualname__, Logged.__doc__ = cls.__name__, cls.__qualname__, cls.__doc__
    Logged.__module__ = cls.__module__
    return Logged
