"""weight_sync.shm: an engine's /dev/shm scratch dir is removed on every exit path, and a dead process's by the next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rayrl.weight_sync.shm import ShmDir, remove_stale
from tests.helpers import ROOT

MAKE = "from rayrl.weight_sync.shm import ShmDir; d = ShmDir({base!r}); print(d.path, flush=True); "


def _child(base, tail: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", MAKE.format(base=str(base)) + tail], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    return p, p.stdout.readline().strip()


def test_dir_is_named_by_pid_and_removed(tmp_path):
    d = ShmDir(str(tmp_path))
    assert os.path.basename(d.path).startswith(f"rayrl-{os.getpid()}-") and os.path.isdir(d.path)
    assert os.listdir(tmp_path) == [os.path.basename(d.path)]  # nothing but the dir
    d.remove()
    d.remove()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tail", ["pass", "raise RuntimeError('boom')", "import sys; sys.exit(3)"])
def test_process_exit_removes_it(tmp_path, tail):
    p, path = _child(tmp_path, tail)
    p.wait(timeout=60)
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)


def test_sigkilled_process_dir_removed_by_the_next_one_live_ones_kept(tmp_path):
    killed, dead_path = _child(tmp_path, "import time; time.sleep(600)")
    live, live_path = _child(tmp_path, "import time; time.sleep(600)")
    try:
        assert os.path.isdir(dead_path) and os.path.isdir(live_path)
        with open(os.path.join(dead_path, "model.safetensors"), "wb") as f:  # a sync cut short
            f.write(b"\0" * 4096)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert os.path.isdir(dead_path)  # SIGKILL runs no code
        d = ShmDir(str(tmp_path))
        assert not os.path.exists(dead_path)
        assert os.path.isdir(live_path)  # its process still holds the lock
        assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(x) for x in (live_path, d.path))
        d.remove()
    finally:
        live.kill()
        live.wait(timeout=30)


def test_lockless_dir_of_an_older_rayrl_goes_by_pid(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    time.sleep(0.1)
    gone, kept, other = (tmp_path / f"rayrl-{dead.pid}-abc", tmp_path / f"rayrl-{os.getpid()}-abc",
                         tmp_path / "not-rayrl-1-x")
    for d in (gone, kept, other):
        d.mkdir()
    assert remove_stale(str(tmp_path)) == [str(gone)]
    assert kept.is_dir() and other.is_dir()
