"""Code execution for agents: `SandboxPool` (plain class) and `SandboxActor` (its Ray shell).

One interface, two backends:

    pool = SandboxPool(SandboxConfig(backend="local"))
    result = await pool.run("print(1 + 1)")       # ExecResult(stdout="2\\n", stderr="", exit_code=0, ...)
    await pool.close()

- `local` (default): every run is a fresh process (`python -S`, no site import: ~8 ms instead of ~30 ms to
  start here) with rlimits, a wall-clock timeout that kills the whole process group, an empty environment, and,
  where the OS allows it (root, or unprivileged user namespaces), new network + mount namespaces: no network,
  a read-only root filesystem, private tmpfs over /tmp, /var/tmp, /dev/shm and the home directories, and (as
  root) a uid of its own per concurrency slot, so the run cannot signal the host's processes and a fork bomb
  hits RLIMIT_NPROC. What is and is not isolated: docs/sandbox.md. Runs are stateless (no session: every call
  starts from nothing).
- `e2b`: the `e2b-code-interpreter` SDK (E2B cloud, or Tencent Agent Sandbox with `e2b_domain`), sandboxes
  created on demand, reused from a pool and killed on `close()`; the API key comes from the env var named by
  `e2b_api_key_env` and is masked in error texts. Jupyter-backed, so state persists between
  runs on one sandbox, and the pool does not pin a sandbox to a trajectory (no sessions): a later episode can
  see variables an earlier one defined on the same sandbox.

Back-pressure: at most `max_concurrency` runs at once, at most `max_queue` waiting; one more raises
`SandboxFull` at once instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import os
import resource
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

# Linux clone/mount flags (not in Python 3.11's os module).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18

_LANGUAGES = {"python": "main.py", "bash": "main.sh"}


class SandboxFull(RuntimeError):
    """Raised at once when `max_queue` runs are already waiting for a slot."""


@dataclass
class ExecResult:
    """One execution. `error` is set when the code did not run to completion (timeout, killed, output limit,
    sandbox failure); a program that raised has `exit_code != 0`, its traceback in `stderr` and no `error`."""

    stdout: str
    stderr: str
    exit_code: int | None
    duration: float  # seconds, wall clock, process start to exit
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


@dataclass
class SandboxConfig:
    """`rollout.agent_config.sandbox`: which backend, its limits, and (for e2b) where and as whom."""

    backend: str = "local"  # local | e2b
    max_concurrency: int = 4  # runs at once (local: processes; e2b: sandboxes in the pool)
    max_queue: int = 256  # runs waiting for a slot; one more raises SandboxFull
    timeout: float = 10.0  # default wall-clock seconds per run
    max_output_bytes: int = 16384  # per stream; the run is killed when its output passes this
    # local backend
    cpu_seconds: int = 10  # RLIMIT_CPU
    memory_mb: int = 1024  # RLIMIT_AS (virtual memory)
    max_processes: int = 64  # RLIMIT_NPROC (enforced only when the run has a uid of its own: root)
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of the private /tmp (and /dev/shm)
    network: bool = False  # True: keep the host network (no network namespace)
    namespaces: str = "auto"  # auto (use them when the OS allows) | require (fail if not) | off
    hide_paths: list[str] = field(default_factory=lambda: ["/root", "/home"])  # covered by an empty tmpfs
    uid_base: int = 61000  # as root, each slot runs as a uid of its own from [uid_base, uid_base + uid_range)
    uid_range: int = 4096  # uids shared by all pools on the machine; each pool claims its own with a lock file
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for the runs
    # e2b backend (seed 001's e2b_code_tool_config.yaml)
    e2b_domain: str | None = None  # e.g. "ap-shanghai.tencentags.com" (Tencent AGS); None = E2B's default
    e2b_api_key_env: str = "E2B_API_KEY"  # NAME of the env var holding the key (the key itself is never logged)
    e2b_template: str | None = None  # e.g. "code-interpreter-v1"
    sandbox_timeout: int = 300  # seconds an idle e2b sandbox lives
    default_timeout: float = 30.0  # e2b per-run timeout when the caller gives none
    default_language: str = "python"
    e2b_api_url: str | None = None  # override the API URL (tests: a local fake server)
    e2b_sandbox_url: str | None = None  # override the sandbox URL (tests)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SandboxConfig:
        raw = dict(raw or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"unknown sandbox config key {unknown[0]!r} (known: {', '.join(sorted(names))})")
        cfg = cls(**raw)
        if cfg.backend not in ("local", "e2b"):
            raise ValueError(f"sandbox.backend={cfg.backend!r} must be 'local' or 'e2b'")
        if cfg.namespaces not in ("auto", "require", "off"):
            raise ValueError(f"sandbox.namespaces={cfg.namespaces!r} must be auto, require or off")
        for name in ("max_concurrency", "timeout", "max_output_bytes", "cpu_seconds", "memory_mb"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(cfg, name)}")
        if cfg.max_queue < 0:
            raise ValueError(f"sandbox.max_queue must be >= 0, got {cfg.max_queue}")
        return cfg


class SandboxPool:
    """Bounded, back-pressured code execution over one backend. Safe to share between many episodes."""

    def __init__(self, config: SandboxConfig | dict[str, Any] | None = None) -> None:
        self.config = config if isinstance(config, SandboxConfig) else SandboxConfig.from_dict(config)
        self._backend: _LocalBackend | _E2BBackend = (
            _LocalBackend(self.config) if self.config.backend == "local" else _E2BBackend(self.config))
        # Free slot ids (local: the slot picks the run's uid); taking one is acquiring the semaphore.
        self._slots: asyncio.Queue[int] | None = None
        self._waiting = 0
        self._reapers: set[asyncio.Task] = set()
        self.stats = {"runs": 0, "errors": 0, "rejected": 0, "seconds": 0.0}

    @property
    def isolation(self) -> dict[str, Any]:
        """What the local backend could set up here (namespaces, uid per slot); {} for e2b."""
        return getattr(self._backend, "isolation", {})

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        """Run `code` once. Raises SandboxFull when the queue is full; every other failure is an ExecResult
        with `error` set."""
        if self._slots is None:  # created lazily: the pool may be built outside the loop that uses it
            self._slots = asyncio.Queue()
            for i in range(self.config.max_concurrency):
                self._slots.put_nowait(i)
        if self._slots.empty() and self._waiting >= self.config.max_queue:
            self.stats["rejected"] += 1
            raise SandboxFull(f"sandbox queue full: {self.config.max_concurrency} running and "
                              f"{self._waiting} waiting (sandbox.max_queue={self.config.max_queue})")
        self._waiting += 1
        try:
            slot = await self._slots.get()
        finally:
            self._waiting -= 1
        released = False
        try:
            result = await self._backend.run(code, language, timeout or self.config.timeout, slot)
            # Clean-up (killing leftovers of the run) happens after the result is returned; the slot is free again
            # only after it, so the next run on this slot never meets them.
            cleanup = self._backend.cleanup(slot)
            if cleanup is not None:
                task = asyncio.ensure_future(self._release_after(cleanup, slot))
                self._reapers.add(task)
                task.add_done_callback(self._reapers.discard)
                released = True
        finally:
            if not released:
                self._slots.put_nowait(slot)
        self.stats["runs"] += 1
        self.stats["seconds"] += result.duration
        self.stats["errors"] += result.error is not None
        return result

    async def _release_after(self, cleanup, slot: int) -> None:
        try:
            await cleanup
        finally:
            self._slots.put_nowait(slot)

    async def close(self) -> None:
        """Wait for clean-ups; kill e2b sandboxes."""
        if self._reapers:
            await asyncio.gather(*self._reapers, return_exceptions=True)
        await self._backend.close()


# --- local backend ----------------------------------------------------------------------------------

class _LocalBackend:
    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.is_root = os.geteuid() == 0
        self.isolation = _probe_isolation(config)
        self.python = os.path.realpath(config.python)
        self._uids: list[int] | None = None  # claimed on first run
        self._uid_locks: list[int] = []
        # The interpreter's own tree: re-exposed when it lies under a hidden path (pyenv in /root, a venv in ~).
        self.keep = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})
        # `python -S` skips site (and its .pth files, which cost ~150 ms here); PYTHONPATH gives the packages back.
        paths = sysconfig.get_paths()
        self.pythonpath = os.pathsep.join(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"])
                                                          if os.path.isdir(p)))

    def _env(self, home: str) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
               "PYTHONPATH": self.pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg",
               # one thread per BLAS: a run must not grab every core, nor reserve per-thread buffers under RLIMIT_AS
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.update(self.config.env)
        return env

    async def run(self, code: str, language: str, timeout: float, slot: int) -> ExecResult:
        if language not in _LANGUAGES:
            return ExecResult("", "", None, 0.0, f"language {language!r} is not supported by the local sandbox "
                                                 f"(supported: {', '.join(_LANGUAGES)})")
        workdir = tempfile.mkdtemp(prefix="rayrl-sandbox-")
        try:
            script = os.path.join(workdir, _LANGUAGES[language])
            with open(script, "w", encoding="utf-8") as f:
                f.write(code)
            uid = self.uid(slot) if self.isolation["uid"] else None
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(script, uid, uid)
            os.chmod(workdir, 0o700)
            home = "/tmp/work" if self.isolation["mount"] else workdir
            argv = ([self.python, "-S", "-s", _LANGUAGES[language]] if language == "python"
                    else ["/bin/bash", _LANGUAGES[language]])
            preexec = _Preexec(self.config, workdir, uid, self.isolation, self.keep)
            return await self._spawn(argv, preexec, self._env(home), timeout)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _spawn(self, argv: list[str], preexec: _Preexec, env: dict[str, str], timeout: float) -> ExecResult:
        limit = self.config.max_output_bytes
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, preexec_fn=preexec, close_fds=True)
        except Exception as e:  # noqa: BLE001 - preexec failures arrive as SubprocessError
            return ExecResult("", "", None, time.perf_counter() - start,
                              f"sandbox failed to start: {type(e).__name__}: {e}")
        over: list[str] = []
        out, err = bytearray(), bytearray()

        async def drain(stream: asyncio.StreamReader, buf: bytearray, name: str) -> None:
            while chunk := await stream.read(65536):
                buf += chunk[:limit - len(buf) + 1]
                if len(buf) > limit:
                    del buf[limit:]
                    over.append(name)
                    _killpg(proc.pid)
                    return

        readers = asyncio.gather(drain(proc.stdout, out, "stdout"), drain(proc.stderr, err, "stderr"))
        error = None
        try:
            await asyncio.wait_for(_exited(proc), timeout)
        except TimeoutError:
            error = f"timeout after {timeout:g}s"
        _killpg(proc.pid)  # the main process exited or timed out: whatever it left in its group goes too
        try:
            await asyncio.wait_for(readers, 2.0)  # the pipes close once every holder is dead
        except TimeoutError:
            readers.cancel()  # a process that left the group (setsid) holds a pipe: keep what we have
        try:
            code = await asyncio.wait_for(proc.wait(), 2.0)
        except TimeoutError:  # proc.wait() also waits for the pipes; the exit status is known already
            code = proc.returncode
        duration = time.perf_counter() - start
        if error is None and over:
            error = f"output limit: {over[0]} passed {limit} bytes (sandbox.max_output_bytes); the run was killed"
        elif error is None and code < 0:
            sig = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            error = f"killed by {sig}" + (" (CPU limit)" if -code == signal.SIGXCPU else "")
        return ExecResult(bytes(out).decode("utf-8", "replace"), bytes(err).decode("utf-8", "replace"), code, duration,
                          error)

    def cleanup(self, slot: int):
        """As root, kill every process left with the slot's uid (a run may setsid out of its process group)."""
        if not self.isolation["uid"]:
            return None
        return asyncio.get_running_loop().run_in_executor(None, _reap_uid, self.uid(slot))

    def uid(self, slot: int) -> int:
        """The uid of `slot`, unique on this machine: another pool's reaper (kill(-1) as that uid) or fork bomb
        (RLIMIT_NPROC counts per uid) must never meet this pool's runs."""
        if self._uids is None:
            self._uids, self._uid_locks = _claim_uids(self.config.uid_base, self.config.uid_range,
                                                      self.config.max_concurrency)
        return self._uids[slot]

    async def close(self) -> None:
        for fd in self._uid_locks:
            os.close(fd)  # releases the flock: the uids are free for other pools
        self._uids, self._uid_locks = None, []


_UID_LOCK_DIR = "/tmp/rayrl-sandbox-uids"


def _claim_uids(base: int, span: int, n: int) -> tuple[list[int], list[int]]:
    """Claim `n` uids in [base, base + span) with non-blocking flocks on one root-only lock file per uid. The
    kernel drops a lock when its holder dies, so a crashed pool frees its uids by itself."""
    import fcntl  # noqa: PLC0415

    os.makedirs(_UID_LOCK_DIR, mode=0o700, exist_ok=True)
    uids, fds = [], []
    for uid in range(base, base + span):
        fd = os.open(os.path.join(_UID_LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _has_processes(uid):  # a leftover of a pool that died: not ours to reuse until it is gone
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            continue
        uids.append(uid)
        fds.append(fd)
        if len(uids) == n:
            return uids, fds
    for fd in fds:
        os.close(fd)
    raise RuntimeError(f"sandbox: fewer than {n} free uids in [{base}, {base + span}): other sandbox pools on this "
                       "machine hold them (raise sandbox.uid_range)")


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Wait for the main process to exit. `proc.wait()` also waits for its pipes to close, which a background
    child holding them would delay until the timeout; a pidfd becomes readable at exit, pipes or not."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        await proc.wait()
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_uid(uid: int) -> None:
    """Kill every process of `uid` (blocking, in a thread: an asyncio subprocess here hangs loop shutdown when
    the task is cancelled). kill(-1) from a child that became `uid` reaches exactly that uid's processes."""
    import subprocess  # noqa: PLC0415

    if not _has_processes(uid):  # the usual case: a stat per process is far cheaper than forking a reaper
        return

    def kill_all() -> None:  # in the forked child, before exec
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # raises (and nothing is killed) unless we now are `uid`
        os.kill(-1, signal.SIGKILL)

    subprocess.run(["/bin/true"], preexec_fn=kill_all, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False, timeout=30)


def _has_processes(uid: int) -> bool:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    return True
            except OSError:
                pass  # gone meanwhile
    return False


class _Preexec:
    """Runs in the forked child before exec: limits, namespaces, mounts, uid. Raising aborts the spawn."""

    def __init__(self, config: SandboxConfig, workdir: str, uid: int | None, isolation: dict, keep: list[str]):
        self.config, self.workdir, self.uid, self.isolation, self.keep = config, workdir, uid, isolation, keep

    def __call__(self) -> None:
        # setsid and chdir here, not through Popen's start_new_session/cwd: uvloop (Ray's async actors) applies
        # cwd after preexec_fn, when the host path is already covered by the private /tmp.
        os.setsid()
        os.chdir(self.workdir)
        c = self.config
        mb = 1024 * 1024
        # CPU: SIGXCPU at the soft limit (reported as "CPU limit"), SIGKILL a second later if it is caught.
        resource.setrlimit(resource.RLIMIT_CPU, (c.cpu_seconds, c.cpu_seconds + 1))
        for res, value in ((resource.RLIMIT_AS, c.memory_mb * mb), (resource.RLIMIT_FSIZE, c.max_file_mb * mb),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        if self.isolation["mount"] or self.isolation["net"]:
            _enter_namespaces(c, self.workdir, self.isolation, self.keep)
        if self.uid is not None:
            # NPROC counts the processes of the real uid: it only bites once the run has a uid of its own.
            resource.setrlimit(resource.RLIMIT_NPROC, (c.max_processes, c.max_processes))
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
        else:  # the user's own uid: NPROC counts all their processes, the host's included
            resource.setrlimit(resource.RLIMIT_NPROC, (c.max_processes, c.max_processes))
        # Last: NOFILE caps fd *numbers*, and a parent with many sockets open (a Ray actor) hands this child high fd
        # numbers until exec closes them (close_fds); set earlier, the namespace setup's os.open() fails with EMFILE.
        resource.setrlimit(resource.RLIMIT_NOFILE, (c.max_open_files, c.max_open_files))


_libc = None


def _sys(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enter_namespaces(c: SandboxConfig, workdir: str, isolation: dict, keep: list[str]) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc
    uid, gid = os.getuid(), os.getgid()
    flags = (_CLONE_NEWNET if isolation["net"] else 0) | (_CLONE_NEWNS if isolation["mount"] else 0)
    if isolation["userns"]:
        flags |= _CLONE_NEWUSER
    _sys(libc.unshare(flags), "unshare")
    if isolation["userns"]:
        # Map our own uid/gid into the new namespace, so files we create in the work dir have an owner.
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if not isolation["mount"]:
        return
    _sys(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    # Open what must stay visible before covering it: the work dir (under /tmp) and the interpreter's tree.
    work_fd = os.open(workdir, os.O_PATH)
    covered = (*c.hide_paths, "/tmp", "/var/tmp", "/dev/shm")  # e.g. a virtualenv in /tmp must stay importable
    keep_fds = [(p, os.open(p, os.O_PATH)) for p in keep
                if any(p == h or p.startswith(h.rstrip("/") + "/") for h in covered) and os.path.isdir(p)]
    tmpfs = f"size={c.tmpfs_mb}m,mode=1777".encode()
    for path in covered:
        if os.path.isdir(path):
            opts = tmpfs if path in ("/tmp", "/var/tmp", "/dev/shm") else b"size=1m,mode=0755"
            _sys(libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts), f"mount tmpfs {path}")
    for path, fd in keep_fds:
        os.makedirs(path, exist_ok=True)
        _sys(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None),
             f"bind {path}")
        os.close(fd)
    os.makedirs("/tmp/work")
    _sys(libc.mount(f"/proc/self/fd/{work_fd}".encode(), b"/tmp/work", None, _MS_BIND, None), "bind work dir")
    os.close(work_fd)
    if not isolation["userns"]:
        # Read-only root: a bind remount changes this namespace's view only (the host's / stays rw).
        _sys(libc.mount(None, b"/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None), "remount / read-only")
    os.chdir("/tmp/work")


_PROBED: dict[tuple, dict] = {}


def _probe_isolation(c: SandboxConfig) -> dict[str, Any]:
    """Which isolation this machine allows, found by trying it once in a throw-away child process."""
    want_ns = c.namespaces != "off"
    key = (want_ns, c.network, tuple(c.hide_paths), os.geteuid())
    if key in _PROBED:
        return _PROBED[key]
    root = os.geteuid() == 0
    out = {"uid": root, "userns": not root, "net": want_ns and not c.network, "mount": want_ns, "reason": ""}
    if want_ns:
        import subprocess  # noqa: PLC0415

        workdir = tempfile.mkdtemp(prefix="rayrl-sandbox-probe-")
        try:
            subprocess.run(["/bin/true"], preexec_fn=lambda: _enter_namespaces(c, workdir, out, []),
                           check=True, timeout=10)
        except Exception as e:  # noqa: BLE001 - any failure means "not available here"
            if c.namespaces == "require":
                raise RuntimeError(f"sandbox.namespaces=require, but namespaces are not available here: {e}") from e
            out.update(net=False, mount=False, userns=False, reason=f"namespaces not available: {e}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if out["uid"] and not out["mount"] and not _world_readable(os.path.realpath(c.python)):
        # Without the mount namespace nothing re-exposes an interpreter under a private dir (pyenv in /root).
        out["uid"] = False
        out["reason"] += f"; no uid per slot: {c.python} is not readable by other users"
    _PROBED[key] = out
    return out


def _world_readable(path: str) -> bool:
    """Can any user execute `path` (every parent searchable, the file readable and executable by others)?"""
    import stat  # noqa: PLC0415

    parts = path.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


# --- e2b backend ------------------------------------------------------------------------------------

class _E2BBackend:
    """Sandboxes from the E2B SDK, created on demand up to max_concurrency, reused, killed on close()."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.isolation: dict[str, Any] = {}
        self._idle: list[Any] = []
        self._all: list[Any] = []

    def _api_key(self) -> str:
        key = os.environ.get(self.config.e2b_api_key_env)
        if not key:
            raise RuntimeError(f"sandbox.backend=e2b needs an API key in the environment variable "
                               f"{self.config.e2b_api_key_env!r} (sandbox.e2b_api_key_env), which is not set")
        return key

    async def _acquire(self) -> Any:
        if self._idle:
            return self._idle.pop()
        from e2b_code_interpreter import AsyncSandbox  # noqa: PLC0415 - optional dependency (pip install rayrl[e2b])

        c = self.config
        opts: dict[str, Any] = {"api_key": self._api_key()}
        for name, value in (("domain", c.e2b_domain), ("api_url", c.e2b_api_url), ("sandbox_url", c.e2b_sandbox_url)):
            if value:
                opts[name] = value
        sbx = await AsyncSandbox.create(template=c.e2b_template, timeout=c.sandbox_timeout, **opts)
        self._all.append(sbx)
        return sbx

    async def run(self, code: str, language: str, timeout: float, slot: int) -> ExecResult:
        start = time.perf_counter()
        try:
            sbx = await self._acquire()
        except Exception as e:  # noqa: BLE001 - network, auth, quota: all mean "no sandbox"
            why = _scrub(e, self.config.e2b_api_key_env)
            return ExecResult("", "", None, time.perf_counter() - start, f"e2b: cannot create a sandbox: {why}")
        healthy = True
        try:
            ex = await sbx.run_code(code, language=language or self.config.default_language,
                                    timeout=timeout or self.config.default_timeout)
        except Exception as e:  # noqa: BLE001
            healthy = False  # a sandbox that failed mid-run (timeout, gone) is not reused
            timed_out = "timeout" in type(e).__name__.lower()
            msg = "timeout" if timed_out else f"{type(e).__name__}: {_scrub(e, self.config.e2b_api_key_env)}"
            return ExecResult("", "", None, time.perf_counter() - start, f"e2b: {msg}")
        finally:
            if healthy:
                self._idle.append(sbx)
            else:
                await _kill_quietly(sbx)
        limit = self.config.max_output_bytes
        stdout = "".join(ex.logs.stdout) + "".join(f"{r.text}\n" for r in ex.results if getattr(r, "text", None))
        stderr = "".join(ex.logs.stderr)
        if ex.error is not None:
            stderr += f"{ex.error.name}: {ex.error.value}\n{ex.error.traceback}"
        return ExecResult(stdout[:limit], stderr[:limit], 1 if ex.error is not None else 0,
                          time.perf_counter() - start, None)

    def cleanup(self, slot: int):
        return None

    async def close(self) -> None:
        sandboxes, self._all, self._idle = self._all, [], []
        await asyncio.gather(*(_kill_quietly(s) for s in sandboxes))


async def _kill_quietly(sbx: Any) -> None:
    try:
        await sbx.kill()
    except Exception:  # noqa: BLE001, S110 - best effort on shutdown; the sandbox also expires by itself
        pass


def _scrub(e: Exception, key_env: str) -> str:
    """An exception's text with the API key (if it appears) masked."""
    text = str(e)
    key = os.environ.get(key_env, "")
    return text.replace(key, "***") if key else text


# --- Ray actor ---------------------------------------------------------------------------------------

class SandboxActor:
    """Ray shell over SandboxPool, so episodes on many rollout workers share one node's sandbox budget:
    `ray.remote(SandboxActor).remote(config)`; `await actor.run.remote(code)`."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.pool = SandboxPool(config)

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        try:
            return await self.pool.run(code, language, timeout)
        except SandboxFull as e:
            return ExecResult("", "", None, 0.0, str(e))

    def stats(self) -> dict[str, Any]:
        return {**self.pool.stats, "isolation": self.pool.isolation}

    async def close(self) -> None:
        await self.pool.close()


class ActorSandbox:
    """`ctx.sandbox` backed by a SandboxActor handle: the same `run` signature as SandboxPool."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        return await self.handle.run.remote(code, language, timeout)
