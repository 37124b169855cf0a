"""SandboxPool: bounded, back-pressured code execution over one backend (local.py or e2b.py)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from rayrl.config import SandboxConfig
from rayrl.sandbox.e2b import E2BBackend
from rayrl.sandbox.local import LocalBackend
from rayrl.sandbox.result import ExecResult, SandboxUnavailable

BACKENDS = {"local": LocalBackend, "e2b": E2BBackend}


class SandboxFull(RuntimeError):
    """Raised at once when `max_queue` runs are already waiting for a slot."""


class SandboxPool:
    """At most `max_concurrency` runs at once, at most `max_queue` waiting; one more raises `SandboxFull` at once
    instead of queueing without bound. Safe to share between many episodes of one event loop."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        if self.config.backend not in BACKENDS:
            raise ValueError(f"sandbox.backend={self.config.backend!r} must be one of {', '.join(BACKENDS)}")
        self._backend: LocalBackend | E2BBackend | None = None
        # Free slot ids (local: the slot picks the run's uid); taking one is acquiring the semaphore.
        self._slots: asyncio.Queue[int] | None = None
        self._waiting = 0
        self._reapers: set[asyncio.Task] = set()
        self.stats = {"runs": 0, "errors": 0, "rejected": 0, "unavailable": 0, "seconds": 0.0}

    @property
    def backend(self) -> LocalBackend | E2BBackend:
        """Built on first use: a pool whose agent never runs code costs nothing (no isolation probe)."""
        if self._backend is None:
            self._backend = BACKENDS[self.config.backend](self.config)
            # into the actor's log: which path every run takes here (a zygote fork, or a new interpreter per run)
            print(f"rayrl sandbox: {self.config.backend} backend, {self.config.max_concurrency} slots, isolation "  # noqa: T201
                  f"{self._backend.isolation}", file=sys.stderr, flush=True)
        return self._backend

    async def warm(self) -> None:
        """Set up now what the first runs would wait for (sandbox.warm): the backend and, local, every slot's zygote."""
        warm = getattr(self.backend, "warm", None)
        if warm is not None:
            await warm(self.config.max_concurrency)

    @property
    def isolation(self) -> dict[str, Any]:
        """What the local backend could set up here (namespaces, uid per slot); {} for e2b."""
        return self.backend.isolation

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        """Run `code` once. Raises SandboxFull when the queue is full, SandboxUnavailable when the sandbox service
        failed (e2b, after its retries); what the code did (an exception, a timeout) is an ExecResult."""
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
            try:
                result = await self.backend.run(code, language, timeout or self.config.timeout, slot)
            except SandboxUnavailable:
                self.stats["unavailable"] += 1
                raise
            # Clean-up (killing leftovers of the run) happens after the result is returned; the slot is free again
            # only after it, so the next run on this slot never meets them.
            cleanup = self.backend.cleanup(slot)
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
        """Wait for clean-ups; end the zygotes and free the uids (local); kill the sandboxes (e2b)."""
        if self._reapers:
            await asyncio.gather(*self._reapers, return_exceptions=True)
        if self._backend is not None:
            await self._backend.close()
