"""Session calls in a burst: how long a rollout worker's episodes wait for their Gateway sessions when they start and
end together, per-episode actor calls against the coalesced ones rayrl makes (rayrl.coalesce), in the same run.

A real GatewayActor (as rayrl.cluster starts it: 0 CPUs, max_concurrency 10000, no engine: sessions only) and
`--workers` Ray actors, each starting `--episodes` episodes at once, as a worker does with the tasks of one lease:
open a session, hold it for `--hold-s` (the agent), close it. `per-call`: each episode calls `open_session` and
`close_session` itself (rayrl before this change); `coalesced`: through `Coalesced` over `open_sessions` /
`close_sessions`, as `Rollout.run_task` does now. The modes alternate, `--rounds` each after a warm-up round; printed:
the median and max wait of each call, and the per-call / coalesced ratio of the median open wait.

    python bench/session_burst.py                        # 8 workers x 64 episodes (the GPU bench's 512 in flight)
    python bench/session_burst.py --workers 4 --episodes 32
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import time

import ray

from rayrl.actors.gateway import GatewayActor
from rayrl.coalesce import Coalesced
from rayrl.config import load_config
from rayrl.models import resolve_model


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, gateway):
        self.gw = gateway
        self.open = Coalesced(lambda reqs: asyncio.wait_for(gateway.open_sessions.remote(reqs), 60))
        self.close = Coalesced(lambda sids: asyncio.wait_for(gateway.close_sessions.remote(sids), 60))

    async def burst(self, n: int, hold_s: float, coalesced: bool) -> list[tuple[float, float]]:
        """n episodes at once -> (open wait, close wait) of each."""
        async def episode(i: int) -> tuple[float, float]:
            req = {"task_id": f"t{i}", "budget": 384, "max_prompt": 512}
            t0 = time.perf_counter()
            sid, _, _ = await asyncio.wait_for(self.open(req) if coalesced else self.gw.open_session.remote(**req),
                                               60)
            t1 = time.perf_counter()
            await asyncio.sleep(hold_s)
            t2 = time.perf_counter()
            await asyncio.wait_for(self.close(sid) if coalesced else self.gw.close_session.remote(sid), 60)
            return t1 - t0, time.perf_counter() - t2

        return await asyncio.gather(*(episode(i) for i in range(n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=64, help="started at once by each worker")
    ap.add_argument("--hold-s", type=float, default=0.2, help="how long each episode holds its session")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per mode, after a warm-up round each")
    ap.add_argument("--model", default="smollm2", help="the Gateway's tokenizer (no engine is started)")
    a = ap.parse_args()
    ray.init(num_cpus=max(8, a.workers + 2), include_dashboard=False, log_to_driver=False)
    model = resolve_model(a.model)
    cfg = load_config(None, [f"model.path={model}", "gateway.port=0"])
    gw = GatewayActor.options(num_cpus=0, max_concurrency=10000).remote(cfg, model, [])
    ray.get(gw.stats.remote(), timeout=300)
    workers = [Worker.remote(gw) for _ in range(a.workers)]
    waits: dict[str, list[tuple[float, float]]] = {"per-call": [], "coalesced": []}
    for r in range(a.rounds + 1):
        for mode in waits:
            got = ray.get([w.burst.remote(a.episodes, a.hold_s, mode == "coalesced") for w in workers], timeout=300)
            if r:  # round 0 warms both up
                waits[mode] += [x for g in got for x in g]
    print(f"{datetime.date.today()}: {a.workers} workers x {a.episodes} episodes at once, sessions held "
          f"{a.hold_s} s, {a.rounds} rounds per mode; {os.cpu_count()} cores")
    med = {}
    for mode, ws in waits.items():
        opens, closes = [o for o, _ in ws], [c for _, c in ws]
        med[mode] = statistics.median(opens)
        print(f"{mode:>10}: open wait median {med[mode] * 1e3:7.1f} ms, max {max(opens) * 1e3:7.1f} ms | "
              f"close wait median {statistics.median(closes) * 1e3:7.1f} ms, max {max(closes) * 1e3:7.1f} ms")
    print(f"median open wait, per-call / coalesced: {med['per-call'] / med['coalesced']:.1f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
