"""The local backend: each run is a fresh process on this machine, forked from a per-slot zygote (zygote.py) or
spawned (`python -S`), with rlimits, a wall-clock timeout that kills its process group, an empty environment and,
where the OS allows it, network + mount namespaces and (as root) a uid of its own per slot. What it isolates and
what it does not: docs/sandbox.md."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
from typing import Any

from rayrl.config import SandboxConfig
from rayrl.sandbox import zygote as _zygote
from rayrl.sandbox.result import ExecResult

logger = logging.getLogger(__name__)
_LANGUAGES = _zygote.SCRIPTS


class LocalBackend:
    """Runs as processes of this machine, one per concurrency slot at a time (the pool hands out the slots)."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.python = os.path.realpath(config.python or sys.executable)
        self.isolation = dict(_probe_isolation(config, self.python))  # a copy: the zygote state is this pool's
        self._uids: list[int] | None = None  # claimed on first run
        self._uid_locks: list[int] = []
        # The interpreter's own tree: re-exposed when it lies under a hidden path (pyenv in /root, a venv in ~).
        self.keep = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})
        # `python -S` skips site (and its .pth files, which cost ~150 ms here); PYTHONPATH gives the packages back.
        paths = sysconfig.get_paths()
        self.pythonpath = os.pathsep.join(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"])
                                                          if os.path.isdir(p)))
        # Zygotes (one per slot, started on the slot's first run). In a user namespace (not root) a forked child
        # would keep the namespace's capabilities, which only exec drops: there every run is spawned.
        self.use_zygote = config.zygote and not self.isolation["userns"]
        self._zygotes: dict[int, _Zygote] = {}
        self._starting: dict[int, asyncio.Future] = {}  # slot -> its zygote's start, shared by whoever waits for it
        self.isolation["zygote"] = self.use_zygote

    def _env(self, home: str) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
               "PYTHONPATH": self.pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg",
               # one thread per BLAS: a run must not grab every core, nor reserve per-thread buffers under RLIMIT_AS
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.update(self.config.env)
        return env

    def _limits(self) -> dict[str, Any]:
        """What the process side (zygote.py) needs of the config."""
        c = self.config
        return {"cpu_seconds": c.cpu_seconds, "memory_mb": c.memory_mb, "max_file_mb": c.max_file_mb,
                "max_open_files": c.max_open_files, "max_processes": c.max_processes, "tmpfs_mb": c.tmpfs_mb,
                "hide_paths": list(c.hide_paths)}

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
            zygote = await self._zygote(slot) if self.use_zygote else None
            if zygote is not None:
                request = {"language": language, "workdir": workdir, "uid": uid, "env": self._env(home)}
                return await self._fork(zygote, request, timeout)
            argv = ([self.python, "-S", "-s", _LANGUAGES[language]] if language == "python"
                    else ["/bin/bash", _LANGUAGES[language]])
            preexec = _Preexec(self._limits(), workdir, uid, self.isolation, self.keep)
            return await self._spawn(argv, preexec, self._env(home), timeout)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def warm(self, slots: int) -> None:
        """Start the zygotes of slots 0..slots-1 now (sandbox.warm), not at their first runs."""
        if self.use_zygote:
            await asyncio.gather(*(self._zygote(slot) for slot in range(slots)))

    async def _zygote(self, slot: int) -> _Zygote | None:
        """The slot's zygote, (re)started if it is not running; None (and spawning from now on) if it cannot start.
        One start per slot at a time: a run that comes while warm() starts its slot's zygote waits for that one."""
        z = self._zygotes.get(slot)
        if z is not None and z.alive():
            return z
        if slot not in self._starting:
            start = self._starting[slot] = asyncio.ensure_future(self._start_zygote(slot))
            start.add_done_callback(lambda _: self._starting.pop(slot, None))
        return await asyncio.shield(self._starting[slot])

    async def _start_zygote(self, slot: int) -> _Zygote | None:
        z = self._zygotes.get(slot)
        if z is not None:
            z.close()
        cfg = {**self._limits(), "isolation": self.isolation, "keep": self.keep, "preload": list(self.config.preload)}
        env = self._env("/tmp/work" if self.isolation["mount"] else "/")
        try:
            z = await asyncio.get_running_loop().run_in_executor(None, _Zygote, self.python, env, cfg)
        except Exception as e:  # noqa: BLE001 - any failure: fall back to one new interpreter per run
            logger.warning("sandbox: the zygote cannot start (%s: %s); spawning a new interpreter per run instead",
                           type(e).__name__, e)
            self.use_zygote = self.isolation["zygote"] = False
            self.isolation["reason"] += f"; no zygote: {type(e).__name__}: {e}"
            return None
        self._zygotes[slot] = z
        return z

    async def _fork(self, zygote: _Zygote, request: dict, timeout: float) -> ExecResult:
        start = time.perf_counter()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        loop = asyncio.get_running_loop()
        try:
            zygote.send(json.dumps(request).encode(), [out_w, err_w])
        except OSError as e:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            zygote.close()
            return ExecResult("", "", None, time.perf_counter() - start, f"sandbox zygote died: {e}")
        os.close(out_w)
        os.close(err_w)
        streams, transports = [], []
        for fd in (out_r, err_r):
            reader = asyncio.StreamReader(limit=1 << 20)
            transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r),
                                                        os.fdopen(fd, "rb", buffering=0))
            streams.append(reader)
            transports.append(transport)
        reply_task = asyncio.ensure_future(zygote.reply())
        try:
            # asyncio.wait: the end of the run (a reply, or the zygote's death), which a timeout does not cancel
            out, err, over, error = await self._supervise(streams, asyncio.wait({reply_task}), zygote.kill, timeout)
            try:
                reply = await asyncio.wait_for(reply_task, 5.0)  # killed: the zygote reaps it and replies
            except (TimeoutError, OSError) as e:
                zygote.close()
                return ExecResult(bytes(out).decode("utf-8", "replace"), bytes(err).decode("utf-8", "replace"), None,
                                  time.perf_counter() - start, f"sandbox zygote died during the run: {e}")
        finally:
            if not reply_task.done():  # cancelled mid-run: the zygote is still busy with it, so end both (EOF kills
                zygote.close()         # the run's group); the slot's next run starts a new zygote
            reply_task.cancel()
            for t in transports:
                t.close()
        if reply.get("setup_error"):
            return ExecResult("", "", None, time.perf_counter() - start,
                              f"sandbox failed to start: {reply['setup_error']}")
        return self._result(out, err, over, error, reply["status"], time.perf_counter() - start)

    async def _spawn(self, argv: list[str], preexec: _Preexec, env: dict[str, str], timeout: float) -> ExecResult:
        start = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, preexec_fn=preexec, close_fds=True)
        except Exception as e:  # noqa: BLE001 - preexec failures arrive as SubprocessError
            return ExecResult("", "", None, time.perf_counter() - start,
                              f"sandbox failed to start: {type(e).__name__}: {e}")
        out, err, over, error = await self._supervise([proc.stdout, proc.stderr], _exited(proc),
                                                      lambda: _killpg(proc.pid), timeout)
        try:
            code = await asyncio.wait_for(proc.wait(), 2.0)
        except TimeoutError:  # proc.wait() also waits for the pipes; the exit status is known already
            code = proc.returncode
        return self._result(out, err, over, error, code, time.perf_counter() - start)

    async def _supervise(self, streams: list[asyncio.StreamReader], exited, kill, timeout: float):
        """Read stdout/stderr up to the output limit (past it: `kill()`) until `exited`, or the timeout (`kill()`).
        Returns (stdout, stderr, the streams that overflowed, timeout error or None)."""
        limit = self.config.max_output_bytes
        over: list[str] = []
        out, err = bytearray(), bytearray()

        async def drain(stream: asyncio.StreamReader, buf: bytearray, name: str) -> None:
            while chunk := await stream.read(65536):
                buf += chunk[:limit - len(buf) + 1]
                if len(buf) > limit:
                    del buf[limit:]
                    over.append(name)
                    kill()
                    return

        readers = asyncio.gather(drain(streams[0], out, "stdout"), drain(streams[1], err, "stderr"))
        error = None
        try:
            await asyncio.wait_for(exited, timeout)
        except TimeoutError:
            error = f"timeout after {timeout:g}s"
        kill()  # the main process exited or timed out: whatever it left in its group goes too
        try:
            await asyncio.wait_for(readers, 2.0)  # the pipes close once every holder is dead
        except TimeoutError:
            readers.cancel()  # a process that left the group (setsid) holds a pipe: keep what we have
        return out, err, over, error

    def _result(self, out: bytearray, err: bytearray, over: list[str], error: str | None, code: int | None,
                duration: float) -> ExecResult:
        if error is None and over:
            error = (f"output limit: {over[0]} passed {self.config.max_output_bytes} bytes "
                     "(sandbox.max_output_bytes); the run was killed")
        elif error is None and code is not None and code < 0:
            sig = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            error = f"killed by {sig}" + (" (CPU limit)" if -code == signal.SIGXCPU else "")
        return ExecResult(bytes(out).decode("utf-8", "replace"), bytes(err).decode("utf-8", "replace"), code, duration,
                          error)

    def cleanup(self, slot: int):
        """As root, kill every process left with the slot's uid (a run may setsid out of its process group): None
        when there is none (the usual case, known by one syscall), else the future of the reaper, in a thread."""
        if not self.isolation["uid"] or not _has_processes(self.uid(slot)):
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
        zygotes, self._zygotes = list(self._zygotes.values()), {}
        for z in zygotes:
            z.close()
        for fd in self._uid_locks:
            os.close(fd)  # releases the flock: the uids are free for other pools
        self._uids, self._uid_locks = None, []


class _Zygote:
    """The pool's end of one zygote process (zygote.py): started clean (a new interpreter,
    the run's environment, no inherited fd but its socket), one request at a time."""

    def __init__(self, python: str, env: dict[str, str], cfg: dict[str, Any]) -> None:
        import subprocess

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [python, "-S", "-s", _zygote.__file__, str(theirs.fileno())], env=env, cwd="/",
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                close_fds=True, pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        self.sock.settimeout(60)
        try:
            self.sock.sendall(json.dumps(cfg).encode())
            reply = json.loads(self.sock.recv(1 << 16) or b'{"error": "exited at start"}')
        except BaseException:
            self.close()
            raise
        if "error" in reply:
            self.close()
            raise RuntimeError(reply["error"])
        self.sock.setblocking(False)
        self.busy = False

    def alive(self) -> bool:
        return self.sock.fileno() >= 0 and self.proc.poll() is None

    def send(self, msg: bytes, fds: list[int]) -> None:
        self.busy = True
        socket.send_fds(self.sock, [msg], fds)  # nonblocking, but the socket is empty: one request at a time

    async def reply(self) -> dict:
        msg = await asyncio.get_running_loop().sock_recv(self.sock, 1 << 16)
        if not msg:
            raise OSError("the zygote exited")
        self.busy = False
        return json.loads(msg)

    def kill(self) -> None:
        """Kill the running child's process group (the zygote does it: the pid is its child's)."""
        if self.busy:
            try:
                self.sock.send(b"k")
            except OSError:
                pass

    def close(self) -> None:
        """EOF ends the zygote (and kills a run still going); SIGKILL if it has not exited within 2 s."""
        self.sock.close()
        try:
            self.proc.wait(2.0)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


_UID_LOCK_DIR = "/tmp/rayrl-sandbox-uids"


def _claim_uids(base: int, span: int, n: int) -> tuple[list[int], list[int]]:
    """Claim `n` uids in [base, base + span) with non-blocking flocks on one root-only lock file per uid. The
    kernel drops a lock when its holder dies, so a crashed pool frees its uids by itself."""
    import fcntl

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
    import subprocess

    if not _has_processes(uid):  # (gone meanwhile)
        return

    def kill_all() -> None:  # in the forked child, before exec
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # raises (and nothing is killed) unless we now are `uid`
        os.kill(-1, signal.SIGKILL)

    subprocess.run(["/bin/true"], preexec_fn=kill_all, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False, timeout=30)


def _has_processes(uid: int) -> bool:
    """Whether any process (zombies included) has the real uid `uid`: getpriority(PRIO_USER) fails with ESRCH when
    none does. One syscall (the kernel walks its task list), where a stat of every /proc entry, after each run, was
    40-59% of a rollout worker's py-spy samples on a GPU host with ~400 processes."""
    try:
        os.getpriority(os.PRIO_USER, uid)
    except ProcessLookupError:
        return False
    return True


class _Preexec:
    """Runs in the forked child before exec (the spawn path): limits, namespaces, mounts, uid. Raising aborts the
    spawn. `limits` is `LocalBackend._limits()`; the steps are zygote.py's, all in this one child."""

    def __init__(self, limits: dict, workdir: str, uid: int | None, isolation: dict, keep: list[str]):
        self.limits, self.workdir, self.uid, self.isolation, self.keep = limits, workdir, uid, isolation, keep

    def __call__(self) -> None:
        # setsid and chdir here, not through Popen's start_new_session/cwd: uvloop (Ray's async actors) applies
        # cwd after preexec_fn, when the host path is already covered by the private /tmp.
        os.setsid()
        os.chdir(self.workdir)
        _zygote.set_limits(self.limits)
        if self.isolation["mount"] or self.isolation["net"]:
            _zygote.enter_namespaces(self.limits, self.workdir, self.isolation, self.keep)
        _zygote.become(self.uid, self.limits)
        # Last: NOFILE caps fd *numbers*, and a parent with many sockets open (a Ray actor) hands this child high fd
        # numbers until exec closes them (close_fds); set earlier, the namespace setup's os.open() fails with EMFILE.
        n = self.limits["max_open_files"]
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


_PROBED: dict[tuple, dict] = {}


def _probe_isolation(c: SandboxConfig, python: str) -> dict[str, Any]:
    """Which isolation this machine allows, found by trying it once in a throw-away child process."""
    want_ns = c.namespaces != "off"
    key = (want_ns, c.network, tuple(c.hide_paths), python, os.geteuid())
    if key in _PROBED:
        return _PROBED[key]
    root = os.geteuid() == 0
    out = {"uid": root, "userns": not root, "net": want_ns and not c.network, "mount": want_ns, "reason": ""}
    if want_ns:
        import subprocess

        workdir = tempfile.mkdtemp(prefix="rayrl-sandbox-probe-")
        limits = {"hide_paths": list(c.hide_paths), "tmpfs_mb": c.tmpfs_mb}
        try:
            subprocess.run(["/bin/true"], preexec_fn=lambda: _zygote.enter_namespaces(limits, workdir, out, []),
                           check=True, timeout=10)
        except Exception as e:  # any failure means "not available here"
            if c.namespaces == "require":
                raise RuntimeError(f"sandbox.namespaces=require, but namespaces are not available here: {e}") from e
            out.update(net=False, mount=False, userns=False, reason=f"namespaces not available: {e}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if out["uid"] and not out["mount"] and not _world_readable(python):
        # Without the mount namespace nothing re-exposes an interpreter under a private dir (pyenv in /root).
        out["uid"] = False
        out["reason"] += f"; no uid per slot: {python} is not readable by other users"
    _PROBED[key] = out
    return out


def _world_readable(path: str) -> bool:
    """Can any user execute `path` (every parent searchable, the file readable and executable by others)?"""
    import stat

    parts = path.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)

