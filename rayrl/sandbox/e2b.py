"""The e2b backend: sandboxes from the `e2b-code-interpreter` SDK (E2B cloud, or Tencent Agent Sandbox with
`e2b_domain`), created on demand up to `max_concurrency`, reused, replaced after a failed run, killed on `close()`.
The API key comes from the env var named by `e2b_api_key_env` and is masked in error texts. Jupyter-backed: state
persists between runs on one sandbox, and a sandbox is not pinned to a trajectory (no sessions), so a later episode
can see variables an earlier one defined on the same sandbox."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rayrl.config import SandboxConfig
from rayrl.sandbox.result import ExecResult


class E2BBackend:
    """Sandboxes from the E2B SDK, created on demand up to max_concurrency, reused, killed on close()."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.isolation: dict[str, Any] = {}
        self._idle: list[Any] = []
        self._all: list[Any] = []

    def _api_key(self) -> str:
        key = os.environ.get(self.config.e2b_api_key_env)
        if not key:
            raise RuntimeError(f"sandbox.backend=e2b needs an API key in the environment variable "
                               f"{self.config.e2b_api_key_env!r} (sandbox.e2b_api_key_env), which is not set")
        return key

    async def _acquire(self) -> Any:
        if self._idle:
            return self._idle.pop()
        from e2b_code_interpreter import AsyncSandbox  # optional dependency (pip install rayrl[e2b])

        c = self.config
        opts: dict[str, Any] = {"api_key": self._api_key()}
        for name, value in (("domain", c.e2b_domain), ("api_url", c.e2b_api_url), ("sandbox_url", c.e2b_sandbox_url)):
            if value:
                opts[name] = value
        sbx = await AsyncSandbox.create(template=c.e2b_template, timeout=c.sandbox_timeout, **opts)
        self._all.append(sbx)
        return sbx

    async def run(self, code: str, language: str, timeout: float, slot: int) -> ExecResult:
        start = time.perf_counter()
        try:
            sbx = await self._acquire()
        except Exception as e:  # noqa: BLE001 - network, auth, quota: all mean "no sandbox"
            why = _scrub(e, self.config.e2b_api_key_env)
            return ExecResult("", "", None, time.perf_counter() - start, f"e2b: cannot create a sandbox: {why}")
        healthy = True
        try:
            ex = await sbx.run_code(code, language=language, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            healthy = False  # a sandbox that failed mid-run (timeout, gone) is not reused
            timed_out = "timeout" in type(e).__name__.lower()
            msg = "timeout" if timed_out else f"{type(e).__name__}: {_scrub(e, self.config.e2b_api_key_env)}"
            return ExecResult("", "", None, time.perf_counter() - start, f"e2b: {msg}")
        finally:
            if healthy:
                self._idle.append(sbx)
            else:
                await _kill_quietly(sbx)
        limit = self.config.max_output_bytes
        stdout = "".join(ex.logs.stdout) + "".join(f"{r.text}\n" for r in ex.results if getattr(r, "text", None))
        stderr = "".join(ex.logs.stderr)
        if ex.error is not None:
            stderr += f"{ex.error.name}: {ex.error.value}\n{ex.error.traceback}"
        return ExecResult(stdout[:limit], stderr[:limit], 1 if ex.error is not None else 0,
                          time.perf_counter() - start, None)

    def cleanup(self, slot: int):
        return None

    async def close(self) -> None:
        sandboxes, self._all, self._idle = self._all, [], []
        await asyncio.gather(*(_kill_quietly(s) for s in sandboxes))


async def _kill_quietly(sbx: Any) -> None:
    try:
        await sbx.kill()
    except Exception:  # noqa: BLE001 - best effort on shutdown; the sandbox also expires by itself
        pass


def _scrub(e: Exception, key_env: str) -> str:
    """An exception's text with the API key (if it appears) masked."""
    text = str(e)
    key = os.environ.get(key_env, "")
    return text.replace(key, "***") if key else text

