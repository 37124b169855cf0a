"""RAM-backed scratch dirs for weight reloads (`/dev/shm/rayrl-<pid>-*`: a whole model's weights can sit there during
a sync), removed on every exit path: `ShmDir.remove` (engine shutdown); atexit (a normal exit, an exception, and
SIGTERM of a Ray actor, whose handler raises SystemExit); and for a process that runs no code as it dies (SIGKILL,
`ray.kill`, the OOM killer) by the next `ShmDir` made on the node: each dir holds an flock on its `.lock` while its
process lives (the kernel drops it when the process dies), so a dir whose lock can be taken is stale. Unlike a pid
check this holds across pid namespaces that share /dev/shm.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import shutil
import tempfile

PREFIX = "rayrl-"
LOCK = ".lock"


class ShmDir:
    """A fresh `rayrl-<pid>-*` dir in /dev/shm (the temp dir where there is none); stale ones are removed first."""

    def __init__(self, base: str | None = None):
        base = base or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        remove_stale(base)
        # made under a name remove_stale ignores, locked, then renamed: a rayrl-* dir is never seen unlocked
        new = tempfile.mkdtemp(prefix=".new-", dir=base)
        self._lock = os.open(os.path.join(new, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.path = os.path.join(base, f"{PREFIX}{os.getpid()}-{os.path.basename(new)[5:]}")
        os.rename(new, self.path)
        self._pid = os.getpid()
        atexit.register(self.remove)

    def remove(self) -> None:
        """Delete the dir (idempotent; a no-op in a forked child, which inherits the atexit hook)."""
        if self._lock is None or os.getpid() != self._pid:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)
        self._lock = None
        atexit.unregister(self.remove)


def remove_stale(base: str) -> list[str]:
    """Remove the `rayrl-<pid>-*` dirs under `base` whose process is gone; returns their paths."""
    removed = []
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if re.fullmatch(rf"{PREFIX}\d+-\w+", name) and os.path.isdir(path) and not _held(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _held(path: str) -> bool:
    """Whether a live process holds `path`'s lock (a dir without one, of an older rayrl, counts by its pid)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR)
    except FileNotFoundError:
        return _pid_alive(int(os.path.basename(path)[len(PREFIX):].split("-")[0]))
    except OSError:
        return True  # not ours to judge (another user's)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
