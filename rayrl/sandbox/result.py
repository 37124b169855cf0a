"""ExecResult: what one run of a sandbox returns, whichever backend ran it."""

from __future__ import annotations

from dataclasses import dataclass


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
