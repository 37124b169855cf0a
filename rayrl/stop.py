"""Stopping a driver by signal: SIGTERM (what `ray job stop` and Kubernetes send) and SIGINT (Ctrl-C) become a `Stopped`
exception in the main thread, so the driver's `finally` stops the actors, writes the trace and closes the logger, and
`rayrl` prints one line and exits 128 + the signal (143, 130). A second signal during that exits at once, with the
local Ray the driver started.

`install` must run after `ray.init()`, which installs handlers of its own (a local cluster's kills the node and exits
1; Ray's driver handler calls sys.exit); `cluster.connect` calls it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):  # not an Exception: `except Exception` must not swallow a stop
    """The run was stopped by signal `signum`; the driver sets `step` (steps completed) as it unwinds."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.step: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install() -> None:
    """SIGTERM and SIGINT raise `Stopped` in the main thread (a no-op elsewhere: only it can set handlers)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _raise)


def _raise(signum: int, frame) -> None:
    # The first signal unwinds (the cleanup takes seconds); a second one ends the process at once.
    for sig in SIGNALS:
        signal.signal(sig, _now)
    raise Stopped(signum)


def _now(signum: int, frame) -> None:
    """A second signal: exit 128 + signum now, stopping the local Ray this driver started on the way (its raylet, GCS,
    agents and workers outlive a plain exit): SIGTERM, up to 1 s each, then SIGKILL. A SIGKILLed raylet leaves its
    dashboard and runtime-env agents running (seen in tests/e2e/test_shutdown.py); a SIGTERMed one stops them. A
    driver that joined a cluster started nothing: the cluster ends its actors when the driver is gone."""
    sys.stderr.write(f"rayrl: {signal.Signals(signum).name} again: exiting now\n")
    sys.stderr.flush()
    node = getattr(sys.modules.get("ray._private.worker"), "_global_node", None)
    if node is not None:
        try:
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=False)
        except Exception:  # noqa: BLE001 - exiting either way
            pass
    os._exit(128 + signum)


def found(exc: BaseException) -> Stopped | None:
    """The `Stopped` behind `exc`, or None. A signal that lands while Ray's C code runs a Python callback (deserialising
    a result inside `ray.get`) surfaces as a SystemError caused by the `Stopped`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Stopped):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
