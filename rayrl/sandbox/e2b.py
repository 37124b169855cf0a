"""The e2b backend: code runs through the `e2b-code-interpreter` SDK (E2B cloud, or Tencent Agent Sandbox with
`e2b_domain`). Sandboxes are created on demand (at most `max_concurrency`), reused, and killed on `close()`.

- A fresh interpreter for every run: each run gets a code context (a Jupyter kernel) of its own, removed after it,
  so no run sees what another defined — the local backend's contract, and what the tool agent's prompt promises.
- `timeout` bounds each run (the SDK's execution timeout, and a wait of our own: the SDK's HTTP transport may
  stretch it). A run past it is an ExecResult with error "timeout after Ns", as on the local backend.
- A sandbox lives `sandbox_timeout` seconds from its creation or last renewal. Before a run, one with less than the
  run's timeout + RENEW_MARGIN left is renewed (`set_timeout`); one that cannot be renewed, or has expired, is
  replaced.
- Infrastructure errors (a sandbox that cannot be created, 5xx, an expired or unreachable sandbox, a time-out
  talking to the service: `e2b_request_timeout` per call) are retried `e2b_retries` times on a fresh sandbox, after
  `e2b_backoff` seconds doubled each time; if they persist the run raises SandboxUnavailable, so the episode becomes
  a failed trajectory, never tool output the model is trained on. A rejected API key is raised at once.

The API key comes from the env var named by `e2b_api_key_env` and is masked in error texts.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from rayrl.config import SandboxConfig
from rayrl.sandbox.result import ExecResult, SandboxUnavailable

RENEW_MARGIN = 30.0  # seconds of life a sandbox must have beyond a run's timeout (context set-up, clean-up)


class _ServiceError(Exception):
    """An infrastructure failure of one attempt (retried)."""


@dataclass
class _Sandbox:
    sbx: Any  # e2b_code_interpreter.AsyncSandbox
    expires: float  # time.monotonic() at which the service ends its life


class E2BBackend:
    """Sandboxes from the E2B SDK, created on demand up to max_concurrency, reused, killed on close()."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.isolation: dict[str, Any] = {}
        self._idle: list[_Sandbox] = []
        self._all: list[_Sandbox] = []

    def _api_key(self) -> str:
        key = os.environ.get(self.config.e2b_api_key_env)
        if not key:
            raise SandboxUnavailable(f"sandbox.backend=e2b needs an API key in the environment variable "
                                     f"{self.config.e2b_api_key_env!r} (sandbox.e2b_api_key_env), which is not set")
        return key

    async def run(self, code: str, language: str, timeout: float, slot: int) -> ExecResult:
        c = self.config
        failures = []
        for attempt in range(c.e2b_retries + 1):
            if attempt:
                await asyncio.sleep(c.e2b_backoff * 2 ** (attempt - 1))
            try:
                return await self._attempt(code, language, timeout)
            except _ServiceError as e:
                failures.append(str(e))
        raise SandboxUnavailable(f"e2b: {failures[-1]} ({len(failures)} attempts; first: {failures[0]})"
                                 if len(failures) > 1 else f"e2b: {failures[0]}")

    async def _attempt(self, code: str, language: str, timeout: float) -> ExecResult:
        box = await self._acquire(timeout)
        healthy = False
        try:
            context = await self._call("creating a code context", box.sbx.create_code_context(language=language))
            result = await self._execute(box.sbx, context, code, timeout)
            try:  # its kernel goes with it, and a timed-out run still in that kernel
                await self._call("removing the code context", box.sbx.remove_code_context(context))
                healthy = True
            except _ServiceError:
                pass  # the run's result stands; the sandbox is replaced
            return result
        finally:
            if healthy:
                self._idle.append(box)
            else:  # a sandbox that failed is not reused
                await self._discard(box)

    async def _execute(self, sbx: Any, context: Any, code: str, timeout: float) -> ExecResult:
        from e2b_code_interpreter import TimeoutException

        start = time.perf_counter()
        out: list[str] = []
        err: list[str] = []
        try:
            ex = await asyncio.wait_for(sbx.run_code(code, context=context, timeout=timeout,
                                                     on_stdout=lambda m: out.append(m.line),
                                                     on_stderr=lambda m: err.append(m.line)), timeout)
        except (asyncio.TimeoutError, TimeoutException) as e:
            # the SDK's own execution timeout is a TimeoutException too, like a sandbox that died under the run
            if isinstance(e, TimeoutException) and not str(e).startswith("Execution timed out"):
                raise self._failure("running the code", e) from None
            return self._result(out, err, [], None, time.perf_counter() - start, f"timeout after {timeout:g}s")
        except Exception as e:  # noqa: BLE001 - 5xx, connection lost, sandbox gone: the service failed
            raise self._failure("running the code", e) from None
        return self._result(out, err, ex.results, ex.error, time.perf_counter() - start, None)

    def _result(self, out: list[str], err: list[str], results: list, error: Any, duration: float,
                why: str | None) -> ExecResult:
        limit = self.config.max_output_bytes
        stdout = "".join(out) + "".join(f"{r.text}\n" for r in results if getattr(r, "text", None))
        stderr = "".join(err)
        if error is not None:
            stderr += f"{error.name}: {error.value}\n{error.traceback}"
        exit_code = None if why else 1 if error is not None else 0
        return ExecResult(stdout[:limit], stderr[:limit], exit_code, duration, why)

    async def _acquire(self, timeout: float) -> _Sandbox:
        """An idle sandbox with the run's timeout + RENEW_MARGIN to live (renewed if need be), else a new one."""
        while self._idle:
            box = self._idle.pop()
            left = box.expires - time.monotonic()
            if left > timeout + RENEW_MARGIN:
                return box
            if left > 1.0:  # still alive: extend its life
                try:
                    await self._call("renewing a sandbox", box.sbx.set_timeout(self.config.sandbox_timeout))
                    box.expires = time.monotonic() + self.config.sandbox_timeout
                    return box
                except _ServiceError:
                    pass
            await self._discard(box)  # expired, or could not be renewed: replaced
        return await self._create()

    async def _create(self) -> _Sandbox:
        from e2b.exceptions import AuthenticationException
        from e2b_code_interpreter import AsyncSandbox  # optional dependency (pip install rayrl[e2b])

        c = self.config
        opts: dict[str, Any] = {"api_key": self._api_key(), "request_timeout": c.e2b_request_timeout}
        for name, value in (("domain", c.e2b_domain), ("api_url", c.e2b_api_url), ("sandbox_url", c.e2b_sandbox_url)):
            if value:
                opts[name] = value
        t0 = time.monotonic()
        try:
            create = AsyncSandbox.create(template=c.e2b_template, timeout=c.sandbox_timeout, **opts)
            sbx = await asyncio.wait_for(create, c.e2b_request_timeout)
        except AuthenticationException as e:  # retrying will not fix a key
            raise SandboxUnavailable(f"e2b: cannot create a sandbox: {self._scrub(e)}") from None
        except Exception as e:  # noqa: BLE001 - network, 5xx, quota: all mean "no sandbox now"
            raise self._failure("creating a sandbox", e) from None
        box = _Sandbox(sbx, t0 + c.sandbox_timeout)
        self._all.append(box)
        return box

    async def _call(self, what: str, call: Any) -> Any:
        """An SDK call to the service, bounded by e2b_request_timeout; any failure is a _ServiceError."""
        try:
            return await asyncio.wait_for(call, self.config.e2b_request_timeout)
        except Exception as e:  # noqa: BLE001
            raise self._failure(what, e) from None

    def _failure(self, what: str, e: BaseException) -> _ServiceError:
        text = self._scrub(e) or ("no answer within sandbox.e2b_request_timeout"
                                  if isinstance(e, asyncio.TimeoutError) else "")
        return _ServiceError((f"{what}: {type(e).__name__}" + (f": {text}" if text else ""))[:500])

    def _scrub(self, e: BaseException) -> str:
        """An exception's text with the API key (if it appears) masked."""
        text = str(e)
        key = os.environ.get(self.config.e2b_api_key_env, "")
        return text.replace(key, "***") if key else text

    async def _discard(self, box: _Sandbox) -> None:
        if box in self._all:
            self._all.remove(box)
        await _kill_quietly(box.sbx)

    def cleanup(self, slot: int):
        return None

    async def close(self) -> None:
        boxes, self._all, self._idle = self._all, [], []
        await asyncio.gather(*(_kill_quietly(b.sbx) for b in boxes))


async def _kill_quietly(sbx: Any) -> None:
    try:
        await asyncio.wait_for(sbx.kill(), 30)
    except Exception:  # noqa: BLE001 - best effort; the sandbox also expires by itself
        pass
