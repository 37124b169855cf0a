"""Checkpoints survive SIGKILL mid-save: a process that trains and saves every step (ckpt_child.py) is killed at 10
random points during its saves; each rerun resumes from checkpoint.latest, the last complete checkpoint, and the model,
optimizer state, RNGs and data position it loads equal the saved ones bit for bit (the child checks its fingerprint);
the last resume is from a save at an epoch boundary. No Ray: heavy (a dozen processes loading torch), so not `unit`."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from rayrl import checkpoint
from tests.helpers import ROOT

pytestmark = pytest.mark.integration
CHILD = os.path.join(os.path.dirname(__file__), "ckpt_child.py")


class Child:
    """The child process and its stdout lines, each with the time it arrived."""

    def __init__(self, out: str, model: str, total: int):
        self.p = subprocess.Popen([sys.executable, CHILD, out, model, str(total)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put((time.monotonic(), line.strip()))
        self.lines.put((time.monotonic(), None))

    def wait_for(self, prefix: str, timeout: float = 300) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while True:
            t, line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"exited {self.p.wait()} before {prefix!r}; printed {self.seen}"
            self.seen.append(line)
            if line.startswith(prefix):
                return t, line

    def rest(self) -> list[str]:
        """Every line after the process ended."""
        self.p.wait(timeout=300)
        while (line := self.lines.get(timeout=30)[1]) is not None:
            self.seen.append(line)
        return self.seen


def committed(lines: list[str]) -> int:
    return max([int(ln.split()[1]) for ln in lines if ln.startswith("committed ")], default=0)


def test_sigkill_during_saves_resumes_bit_for_bit(tiny_model, tmp_path):
    rng = random.Random(7)
    out = str(tmp_path / "run")
    last, save_s, kills, mid_save = 0, None, [], 0
    for _ in range(10):
        c = Child(out, tiny_model, total=1000)
        assert last == 0 or checkpoint.latest(out) is not None
        if checkpoint.latest(out) is not None:
            _, line = c.wait_for("resumed ")
            resumed = int(line.split()[1])
            # the last complete checkpoint: the last commit seen, or the one the kill hit after it had renamed
            assert last <= resumed <= kills[-1], (line, last, kills)
            assert checkpoint.latest(out) == os.path.join(out, "checkpoints", f"step_{resumed}")
        t0, line = c.wait_for("saving ")
        if save_s is None:  # the first run times a whole save; later kills land anywhere in one
            t1, _ = c.wait_for("committed ")
            save_s = t1 - t0
            t0, line = c.wait_for("saving ")
        time.sleep(rng.uniform(0, 1.2 * save_s))
        c.p.send_signal(signal.SIGKILL)
        lines = c.rest()
        kills.append(max(int(ln.split()[1]) for ln in lines if ln.startswith("saving ")))
        mid_save += committed(lines) < kills[-1]
        last = max(last, committed(lines))
    assert mid_save >= 3, f"only {mid_save} of 10 kills landed inside a save"
    # the last checkpoint of a run that completes is at the end of an epoch; a rerun resumes exactly there. It
    # continues from the newest complete checkpoint: the last commit seen, or one the last kill hit after its rename
    newest = int(os.path.basename(checkpoint.latest(out)).split("_")[1])
    assert last <= newest <= kills[-1], (newest, last, kills)
    total = newest + 2 - newest % 2
    c = Child(out, tiny_model, total=total)
    assert c.rest()[-1] == f"committed {total}" and c.p.returncode == 0, c.seen
    c = Child(out, tiny_model, total=total)
    _, line = c.wait_for("resumed ")
    assert line == f"resumed {total} " + json.dumps({"epoch": total // 2 - 1, "num_rows": 8, "position": 8},
                                                    sort_keys=True)
    assert c.rest() and c.p.returncode == 0
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [f"step_{total - 1}", f"step_{total}"]
