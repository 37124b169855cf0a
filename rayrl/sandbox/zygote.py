"""The local sandbox's process side: namespace and mount set-up, and the zygote that forks one child per run.

Stdlib only: the local backend (local.py) starts this file as a script (`python -S -s zygote.py FD`) with the run's
environment, stdin/stdout/stderr on /dev/null and no other fd than its end of a socketpair, so nothing of the
pool's process (a Ray actor: its memory, fds, env, signal handlers) is inherited. local.py also imports the
namespace helpers for its per-run spawn path (the fallback) and its isolation probe. Run as a script, this file has
its folder as sys.path[0]: no module of rayrl/sandbox/ may take a standard library name (types.py would shadow
`types`).

One zygote per pool slot:
  start   read its config from the socket, import the preload modules (numpy), then (as root) unshare the
          network and mount namespaces once: no network, empty tmpfs over `hide_paths`, read-only `/`.
  per run receive {language, workdir, uid, env} and the write ends of the run's stdout/stderr pipes; fork a child
          that calls setsid, sets rlimits, enters a mount namespace of its own (fresh tmpfs /tmp, /var/tmp,
          /dev/shm; the work dir at /tmp/work), becomes the slot's uid, closes every fd but 0-2, and runs the
          code (python: in the forked interpreter, in a fresh __main__; bash: exec). The zygote itself never
          runs user code; it waits for the child (a 'k' message kills its process group), kills what is left
          in the group while the child is a zombie (its pid cannot be reused yet), reaps it and replies
          {status, setup_error}. EOF on the socket (the pool closed or died) ends the zygote.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys
import traceback
import types

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
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4

TMP_PATHS = ("/tmp", "/var/tmp", "/dev/shm")
SCRIPTS = {"python": "main.py", "bash": "main.sh"}

_libc = None


def _call(name: str, *args) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{tuple(a.decode() if isinstance(a, bytes) else a for a in args)}: "
                           f"{os.strerror(err)}")


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _cover(paths, keep: list[str], opts: bytes) -> None:
    """Empty tmpfs over each of `paths`; the dirs of `keep` that lie under them (the interpreter's tree: pyenv in
    /root, a virtualenv in /tmp) are opened first and bound back on top."""
    keep_fds = [(p, os.open(p, os.O_PATH)) for p in keep if _under(p, paths) and os.path.isdir(p)]
    for path in paths:
        if os.path.isdir(path):
            _call("mount", b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts)
    for path, fd in keep_fds:
        os.makedirs(path, exist_ok=True)
        _call("mount", f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None)
        os.close(fd)


def unshare(isolation: dict, mount: bool) -> None:
    """New network namespace (unless the host network is kept) and, with `mount`, a mount namespace whose mounts
    are all private (nothing propagates back to the host). Not root: a user namespace mapping our own uid."""
    uid, gid = os.getuid(), os.getgid()
    flags = (_CLONE_NEWNET if isolation["net"] else 0) | (_CLONE_NEWNS if mount else 0)
    if isolation["userns"]:
        flags |= _CLONE_NEWUSER
    _call("unshare", flags)
    if isolation["userns"]:
        # Map our own uid/gid into the new namespace, so files we create in the work dir have an owner.
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if mount:
        _call("mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)


def hide(hide_paths: list[str], keep: list[str], isolation: dict) -> None:
    """In the current mount namespace: empty tmpfs over `hide_paths`, then (unless in a user namespace, where
    remounting is not allowed) `/` read-only, in this namespace only (the host's / stays rw)."""
    _cover(hide_paths, keep, b"size=1m,mode=0755")
    if not isolation["userns"]:
        _call("mount", None, b"/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)


def private_tmp(workdir: str, keep: list[str], tmpfs_mb: int) -> None:
    """In the current mount namespace: fresh size-limited tmpfs over /tmp, /var/tmp, /dev/shm and the host work
    dir bound at /tmp/work (writable even when `/` is read-only), which becomes the cwd."""
    work_fd = os.open(workdir, os.O_PATH)  # before /tmp is covered
    _cover(TMP_PATHS, keep, f"size={tmpfs_mb}m,mode=1777".encode())
    os.makedirs("/tmp/work")
    _call("mount", f"/proc/self/fd/{work_fd}".encode(), b"/tmp/work", None, _MS_BIND, None)
    os.close(work_fd)
    # A bind mount copies the read-only flag of the mount it comes from (`/` after hide()): make this one rw,
    # keeping its noexec (a remount that drops a flag inherited from the host fails in a user namespace).
    flags = os.statvfs("/tmp/work").f_flag
    if flags & os.ST_RDONLY:
        _call("mount", None, b"/tmp/work", None,
              _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV | (flags & os.ST_NOEXEC), None)
    os.chdir("/tmp/work")


def enter_namespaces(c: dict, workdir: str, isolation: dict, keep: list[str]) -> None:
    """All of it in one process (the spawn path and the isolation probe): unshare, hide, private tmp."""
    unshare(isolation, mount=isolation["mount"])
    if isolation["mount"]:
        hide(c["hide_paths"], keep, isolation)
        private_tmp(workdir, keep, c["tmpfs_mb"])


def set_limits(c: dict) -> None:
    """rlimits but NPROC (set with the uid) and NOFILE (set last)."""
    mb = 1024 * 1024
    # CPU: SIGXCPU at the soft limit (reported as "CPU limit"), SIGKILL a second later if it is caught.
    resource.setrlimit(resource.RLIMIT_CPU, (c["cpu_seconds"], c["cpu_seconds"] + 1))
    for res, value in ((resource.RLIMIT_AS, c["memory_mb"] * mb), (resource.RLIMIT_FSIZE, c["max_file_mb"] * mb),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))


def become(uid: int | None, c: dict) -> None:
    # NPROC counts the processes of the real uid: it only bites once the run has a uid of its own (else it
    # counts all of the user's processes, the host's included).
    resource.setrlimit(resource.RLIMIT_NPROC, (c["max_processes"], c["max_processes"]))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


# --- the zygote ---------------------------------------------------------------------------------------

def main(fd: int):
    """Serve runs until EOF. Returns only in a forked child, isolated: the request to run at the top level."""
    sock = socket.socket(fileno=fd)
    cfg = json.loads(sock.recv(1 << 20))
    try:
        for name in cfg["preload"]:
            try:
                __import__(name)
            except ImportError:
                pass
        iso = cfg["isolation"]
        if iso["mount"] or iso["net"]:
            unshare(iso, mount=iso["mount"])
            if iso["mount"]:
                hide(cfg["hide_paths"], cfg["keep"], iso)
    except Exception as e:  # noqa: BLE001 - reported to the pool, which falls back to spawning
        sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return None
    sock.send(b'{"ready": true}')
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not msg:
            return None  # the pool closed its end or died
        if msg == b"k":
            for f in fds:
                os.close(f)
            continue  # a kill that arrived after its run had ended
        req = json.loads(msg)
        err_r, err_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            for f in (*fds, err_r, err_w):
                os.close(f)
            sock.send(json.dumps({"status": None, "setup_error": f"fork: {e}"}).encode())
            continue
        if pid == 0:
            os.close(err_r)
            return _child(cfg, req, fds, err_w, sock)
        for f in (*fds, err_w):
            os.close(f)
        status = _wait(pid, sock)
        with os.fdopen(err_r, "rb") as f:
            setup_error = f.read().decode("utf-8", "replace") or None
        if status is None:
            return None  # EOF while the run was going: it is killed, and so are we
        sock.send(json.dumps({"status": status, "setup_error": setup_error}).encode())


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(pid: int, sock: socket.socket) -> int | None:
    """Wait for the child; 'k' on the socket kills its group. Returns its exit code (-N: signal N), None on EOF."""
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(sock.fileno(), select.POLLIN)
    eof = False
    try:
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if pidfd in ready:
                break
            msg = sock.recv(1 << 20)
            if msg == b"k" or not msg:
                _killpg(pid)
                if not msg:
                    eof = True
                    poller.unregister(sock.fileno())
    finally:
        os.close(pidfd)
    _killpg(pid)  # the child exited but is not reaped: its pid (the group id) is still ours to signal
    _, st = os.waitpid(pid, 0)
    return None if eof else os.waitstatus_to_exitcode(st)


def _child(cfg: dict, req: dict, fds: list[int], err_w: int, sock: socket.socket):
    """In the forked child: isolate, then hand the request back to the top level (`run_user`). Any failure is
    written to `err_w` and ends the child with 255."""
    try:
        os.setsid()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        set_limits(cfg)
        if cfg["isolation"]["mount"]:
            _call("unshare", _CLONE_NEWNS)  # a mount namespace per run: its /tmp dies with it
            private_tmp(req["workdir"], cfg["keep"], cfg["tmpfs_mb"])
        else:
            os.chdir(req["workdir"])
        become(req["uid"], cfg)
        # After setuid (which clears both): die with the zygote; and be "dumpable" as after an exec, so that
        # /proc/<pid> belongs to the slot's uid and the uid reaper (`_has_processes`) sees the run's processes.
        _call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL)
        _call("prctl", _PR_SET_DUMPABLE, 1)
        sock.detach()  # the fd is closed below; the object must not close a later fd of the same number
        max_open = cfg["max_open_files"]
        os.closerange(3, err_w)  # every fd but stdin/stdout/stderr (and the error pipe, until here)
        os.closerange(err_w + 1, 1 << 20)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max_open, max_open))
        # Signal handlers and mask are the zygote's, which never changes them: those of a fresh interpreter.
    except BaseException as e:  # noqa: BLE001
        os.write(err_w, f"{type(e).__name__}: {e}".encode())
        os._exit(255)
    os.close(err_w)  # EOF on the error pipe: set-up succeeded
    return req


def run_user(req: dict) -> None:
    """In the isolated child, at the top level of this script: run the code as `python main.py` would."""
    script = os.path.join(os.getcwd(), SCRIPTS[req["language"]])
    if req["language"] == "bash":
        os.execve("/bin/bash", ["/bin/bash", SCRIPTS["bash"]], req["env"])
    os.environ.clear()
    os.environ.update(req["env"])
    # A fork shares the zygote's random state: reseed what is loaded, as a fresh interpreter would have.
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    sys.argv = [SCRIPTS["python"]]
    sys.path[0] = os.path.dirname(script)
    module = types.ModuleType("__main__")
    module.__file__ = script
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    status = 0
    try:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        exec(code, module.__dict__)  # the point of a sandbox
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:  # noqa: BLE001 - printed like the interpreter does, without this file's frames
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        status = 1
    _exit(status)


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)  # noqa: T201 - as the interpreter reports sys.exit('message')
    return 1


def _exit(status: int) -> None:
    """Exit as the interpreter would (wait for non-daemon threads, run atexit, flush), but skip tearing the
    interpreter down: with numpy loaded, that alone takes ~40 ms (more than the whole run)."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or replaced stream: nothing left to flush
                pass
        os._exit(status)

if __name__ == "__main__":
    job = main(int(sys.argv[1]))
    if job is not None:
        run_user(job)
