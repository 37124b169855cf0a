"""ExecResult: what one run of a sandbox returns, whichever backend ran it; SandboxUnavailable: what it raises when
the sandbox service itself failed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExecResult:
    """One execution. `error` is set when the code did not run to completion (timeout, killed, output limit);
    a program that raised has `exit_code != 0`, its traceback in `stderr` and no `error`. Either way it is what
    the code did, and the model may see it."""

    stdout: str
    stderr: str
    exit_code: int | None
    duration: float  # seconds, wall clock, process start to exit
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


class SandboxUnavailable(RuntimeError):
    """The sandbox service failed (no sandbox, 5xx, an expired sandbox, a time-out talking to it) and retries did not
    help. Raised, never returned as an ExecResult: the episode fails instead of training on the service's error."""
