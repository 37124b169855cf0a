"""ActorSandbox: the `ctx.sandbox` a rollout worker hands to agents when `sandbox.num_actors` > 0, backed by a
SandboxActor handle (rayrl/actors/sandbox.py) with the same `run` signature as SandboxPool."""

from __future__ import annotations

from typing import Any

from rayrl.sandbox.result import ExecResult


class ActorSandbox:
    """`ctx.sandbox` backed by a SandboxActor handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        return await self.handle.run.remote(code, language, timeout)
