"""Where the actors' own output goes. By default (`trainer.verbose: false`) every rayrl actor sends its process's
stdout and stderr, and so those of vLLM, Ray's worker, and every child process (vLLM's EngineCore, the reward pool)
to `<output_dir>/logs/<role>-<i>.log`, and the driver does not stream actor output: the console holds the driver's
lines only (progress, step lines, rayrl's warnings, errors). An actor's error reaches the driver with its log's path
(the actor's repr, which Ray puts in the error); `failure` makes of such an error the one line the CLI prints.
`trainer.verbose: true` (`rayrl train --verbose`) leaves every actor's output on the console, as Ray streams it.

The driver passes the log folder to every actor in the job's runtime_env (`runtime_env`, used by cluster.connect);
the Ray shells (rayrl/actors/) wrap each class with `to_file`, whose constructor redirects before the class's own.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import datetime, timezone

ENV = "RAYRL_LOG_DIR"  # the absolute folder actors write their logs to; unset: output stays where Ray puts it


def log_dir(output_dir: str, verbose: bool) -> str | None:
    """The absolute folder the actors write their logs to; None when verbose (their output stays on the console)."""
    return None if verbose else os.path.join(os.path.abspath(output_dir), "logs")


def where(folder: str | None, actor_name: str) -> str:
    """` (log: <the actor's log file>)` for a console line about the actor; empty when verbose (`folder` None)."""
    return f" (log: {log_path(folder, actor_name)})" if folder else ""


def divert_raylet_errors(folder: str) -> None:
    """Ray's driver prints the raylet's error messages ("A worker died or was killed while executing a task...") on
    the console whatever log_to_driver says (its error-listener thread); rayrl reports those deaths itself, as one
    `rayrl:` line or a recovery. They go to FOLDER/raylet-errors.log instead; other output prints as Ray would."""
    import ray._private.worker as ray_worker  # the listener looks the function up here at each message

    original = getattr(ray_worker.print_to_stdstream, "rayrl_original", ray_worker.print_to_stdstream)
    path = os.path.join(folder, "raylet-errors.log")

    def to_file(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            return original(data, ignore_prefix)
        os.makedirs(folder, exist_ok=True)
        with open(path, "a") as f:
            f.writelines(f"{line}\n" for line in data.get("lines", []))
        return None

    to_file.rayrl_original = original
    ray_worker.print_to_stdstream = to_file


def runtime_env(output_dir: str, verbose: bool, local: bool) -> dict | None:
    """The job-level runtime_env for ray.init: the log folder (unless verbose), and log dedup on a local cluster."""
    env = {"RAY_DEDUP_LOGS": "1"} if local else {}
    if not verbose:
        env[ENV] = log_dir(output_dir, verbose)
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


# What Ray's errors say about the actor: a RayTaskError's header ends in `repr=<the actor's repr>)` (to_file's
# `name, log: path`), an ActorDiedError lists `name: ...` and `ip: ...` on lines of their own.
_REPR = re.compile(r"\bip=([^,)]+).*\brepr=(.+?)\)$", re.M)
_NAME, _CLASS, _IP = (re.compile(rf"^\t{k}: (.+)$", re.M) for k in ("name", "class_name", "ip"))


def failure(e: BaseException, folder: str | None) -> str | None:
    """`<actor> failed: <the error's last line> (log: <its file>)` for an error an actor raised or died of anywhere in
    `e`'s chain (the innermost one: where it started), or None when no actor is behind `e`. `folder`: log_dir's."""
    import ray

    where, last = None, None
    for err in chain(e):
        text = str(err)
        if isinstance(err, (ray.exceptions.RayTaskError, ray.exceptions.RayActorError)):
            where = _actor(text, folder) or where
            last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), type(err).__name__)
        else:  # an exception object (a RayTaskError's cause): its type and first line
            last = f"{type(err).__name__}: {text.splitlines()[0]}" if text.strip() else type(err).__name__
    if where is None:
        return None
    name, log, ip = where
    here = ray.util.get_node_ip_address()
    at = f" (log: {log}{f' on {ip}' if ip and ip != here else ''})" if log else ""
    return f"{name.removeprefix('rayrl/')} failed: {last}{at}"


def _actor(text: str, folder: str | None) -> tuple[str, str | None, str | None] | None:
    """(actor name, its log file, its node's ip) from a Ray error's text; the last actor named is the innermost."""
    if found := _REPR.findall(text):
        ip, rep = found[-1]
        name, _, log = rep.partition(", log: ")
        return name, log or None, ip
    name = _NAME.search(text) or _CLASS.search(text)
    if name is None:
        return None
    ip = _IP.search(text)
    log = log_path(folder, name.group(1)) if folder and name.re is _NAME else None
    return name.group(1), log, ip and ip.group(1)


def chain(e: BaseException | None):
    """`e`, then what caused it: a RayTaskError's cause (the exception the actor raised), else __cause__/__context__."""
    import ray

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else None
        e = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
