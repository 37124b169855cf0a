"""SandboxActor: the Ray shell over SandboxPool (rayrl/sandbox/), so that episodes on many rollout workers share one
node's sandbox budget (`sandbox.num_actors`); its client is rayrl.sandbox.client.ActorSandbox.
Its output goes to its log file (rayrl.logs)."""

from __future__ import annotations

from typing import Any

import ray

from rayrl.config import SandboxConfig
from rayrl.logs import to_file
from rayrl.sandbox import ExecResult, SandboxFull, SandboxPool


@ray.remote
@to_file
class SandboxActor:
    """`SandboxActor.options(...).remote(cfg.sandbox)`; `await actor.run.remote(code)`."""

    def __init__(self, config: SandboxConfig) -> None:
        self.pool = SandboxPool(config)

    async def run(self, code: str, language: str = "python", timeout: float | None = None) -> ExecResult:
        # A full queue comes back as a result, not as an exception wrapped in a RayTaskError and its traceback.
        try:
            return await self.pool.run(code, language, timeout)
        except SandboxFull as e:
            return ExecResult("", "", None, 0.0, str(e))

    async def warm(self) -> None:
        """sandbox.warm: start every slot's zygote now (the driver calls it once the actor is created)."""
        await self.pool.warm()

    def stats(self) -> dict[str, Any]:
        return {**self.pool.stats, "isolation": self.pool.isolation}

    async def close(self) -> None:
        await self.pool.close()

