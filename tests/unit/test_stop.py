"""rayrl.stop + cli.run_driver without Ray: SIGTERM / SIGINT raise Stopped in the main thread, the driver's finally
runs, one line names the signal, the step and the last checkpoint, and the exit code is 128 + the signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

DRIVER = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as under a terminal: a background job starts with it ignored
from rayrl import checkpoint, stop
from rayrl.cli import run_driver
from rayrl.config import load_config

def driver(cfg):
    tmp = checkpoint.begin(cfg.trainer.output_dir, 1)
    checkpoint.commit(tmp, 1, {{"step": 1}})
    {install}
    step = 1
    try:
        print("ready", flush=True)
        while True:
            try:
                time.sleep(0.05)
            except stop.Stopped as s:  # as Ray's deserializer reports a signal that lands in its Python callback
                if {wrap}:
                    raise SystemError("<built-in method __new__> returned a result with an exception set") from s
                raise
            step += 1
    except BaseException as e:  # as train.py and sft.py unwind
        if (stopped := stop.found(e)) is None:
            raise
        stopped.step = step
        raise stopped from None
    finally:
        print("unwinding", flush=True)
        time.sleep({unwind})  # the actors' stop, the trace
        open(os.path.join(cfg.trainer.output_dir, "finally-ran"), "w").close()

sys.exit(run_driver(driver, load_config(None, ["trainer.output_dir={out}"], check_files=False)))
"""


def _run(tmp_path, sig: int, install: bool = True, wrap: bool = False, again: bool = False) -> tuple[int, str]:
    """Run DRIVER, signal it once ready (with `again`, once more while it unwinds) -> (exit code, stderr)."""
    code = DRIVER.format(out=tmp_path, install="stop.install()" if install else "", wrap=wrap,
                         unwind=30 if again else 0)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert p.stdout.readline().strip() == "ready", p.communicate()
    time.sleep(0.2)
    p.send_signal(sig)
    if again:
        assert p.stdout.readline().strip() == "unwinding"
        p.send_signal(sig)
    _, err = p.communicate(timeout=20)  # (an unwinding that `again` did not cut short takes 30 s)
    return p.returncode, err


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "inside-ray-get"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_unwinds_the_driver(tmp_path, sig, wrap):
    rc, err = _run(tmp_path, sig, wrap=wrap)
    assert rc == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # no traceback
    want = rf"rayrl: stopped by {sig.name} at step \d+ \(last checkpoint: {tmp_path}/checkpoints/step_1\)"
    assert re.fullmatch(want, lines[0]), lines[0]
    assert int(lines[0].split("at step ")[1].split()[0]) > 1  # the step the driver reached, not 0
    assert (tmp_path / "finally-ran").exists()


def test_ctrl_c_before_ray_started_is_one_line(tmp_path):
    rc, err = _run(tmp_path, signal.SIGINT, install=False)
    assert rc == 130 and err.strip().splitlines() == ["rayrl: stopped by SIGINT before the run started"], err
    assert (tmp_path / "finally-ran").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_while_unwinding_exits_at_once(tmp_path, sig):
    rc, err = _run(tmp_path, sig, again=True)
    assert rc == 128 + sig, err
    assert err.strip().splitlines() == [f"rayrl: {sig.name} again: exiting now"], err
    assert not (tmp_path / "finally-ran").exists()  # cut short
