"""ActorSandbox: the `ctx.sandbox` a rollout worker hands to agents when `sandbox.num_actors` > 0, backed by a
SandboxActor handle (rayrl/actors/sandbox.py) with the same `run` signature as SandboxPool."""

from __future__ import annotations

from typing import Any

import ray

from rayrl.recovery import InfraError
from rayrl.sandbox.result import ExecResult


class ActorSandbox:
    """`ctx.sandbox` backed by a SandboxActor handle. The actor dying (or not answering) raises InfraError: the
    episode is run again (rayrl.recovery), it is not the agent's failure."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        try:
            return await self.handle.run.remote(code, language, timeout)
        except ray.exceptions.RayActorError as e:
            raise InfraError("sandbox", f"{type(e).__name__}: {e}".splitlines()[0][:500]) from e
