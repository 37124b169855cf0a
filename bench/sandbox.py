"""Local sandbox latency and throughput against a bare `subprocess.run([python, -c, ...])` in the same run.

    python bench/sandbox.py [--runs 40] [--concurrency 2]

For a trivial snippet and a numpy snippet, prints p50/p99 latency of one run at a time, and executions/s with
`--concurrency` runs in flight (and per core), for:
  bare       subprocess.run([sys.executable, "-c", code])       (site imported: what a naive sandbox pays)
  bare -S    subprocess.run([sys.executable, "-S", "-c", code])  (the interpreter alone)
  pool       SandboxPool(), default isolation (namespaces, uid, rlimits, tmp dirs): runs forked from per-slot zygotes
  pool spawn SandboxPool(SandboxConfig(zygote=False)): the same isolation, a new `python -S` per run (the fallback path)
  pool no-ns SandboxPool(SandboxConfig(namespaces="off")): rlimits + uid, no namespaces (zygotes)
The pools are warmed up first (one run per slot: the isolation probe, and starting the zygotes, whose one-time
cost, mostly `import numpy`, is printed as `first run` and not counted in the rows).
Targets: p50 <= 30 ms, >= 50 exec/s per core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from rayrl.config import SandboxConfig
from rayrl.sandbox import SandboxPool

SNIPPETS = {"trivial": "print(1 + 1)", "numpy": "import numpy as np\nprint(int(np.arange(10).sum()))"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bare(flags: list[str], code: str, runs: int, conc: int) -> tuple[list[float], float]:
    env = {"PATH": "/usr/bin:/bin"}
    if "-S" in flags:  # -S drops site-packages: give numpy back the way the pool does
        import sysconfig

        env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    lat = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, env=env, check=True)
        lat.append(time.perf_counter() - t)

    async def many() -> float:
        sem = asyncio.Semaphore(conc)

        async def one() -> None:
            async with sem:
                p = await asyncio.create_subprocess_exec(sys.executable, *flags, "-c", code, env=env,
                                                         stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                await p.communicate()
        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(runs)))
        return runs / (time.perf_counter() - t)
    return lat, asyncio.run(many())


def pool(cfg: dict, code: str, runs: int, conc: int) -> tuple[list[float], float, float]:
    """(latencies, exec/s, seconds of the warm-up)."""
    async def go() -> tuple[list[float], float, float]:
        p = SandboxPool(SandboxConfig(max_concurrency=conc, **cfg))
        t = time.perf_counter()
        await asyncio.gather(*(p.run(code) for _ in range(conc)))  # warm-up: isolation probe, one zygote per slot
        warm = time.perf_counter() - t
        lat = []
        for _ in range(runs):
            t = time.perf_counter()
            r = await p.run(code)
            lat.append(time.perf_counter() - t)
            assert r.ok, r
        t = time.perf_counter()
        rs = await asyncio.gather(*(p.run(code) for _ in range(runs)))
        rate = runs / (time.perf_counter() - t)
        assert all(r.ok for r in rs)
        await p.close()
        return lat, rate, warm
    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    print(f"cores={cores} runs={a.runs} concurrency={a.concurrency} python={sys.version.split()[0]} "
          f"isolation={SandboxPool().isolation}")
    print(f"{'snippet':8} {'peer':12} {'p50 ms':>8} {'p99 ms':>8} {'exec/s':>8} {'/core':>7}")
    for name, code in SNIPPETS.items():
        rows = {"bare": bare([], code, a.runs, a.concurrency), "bare -S": bare(["-S"], code, a.runs, a.concurrency),
                "pool": pool({}, code, a.runs, a.concurrency),
                "pool spawn": pool({"zygote": False}, code, a.runs, a.concurrency),
                "pool no-ns": pool({"namespaces": "off"}, code, a.runs, a.concurrency)}
        for peer, (lat, rate, *_) in rows.items():
            print(f"{name:8} {peer:12} {1000 * statistics.median(lat):8.1f} {1000 * pct(lat, 0.99):8.1f} "
                  f"{rate:8.1f} {rate / cores:7.1f}")
        ratio = statistics.median(rows["pool"][0]) / statistics.median(rows["bare"][0])
        speedup = rows["pool"][1] / rows["pool spawn"][1]
        print(f"{name:8} pool p50 / bare p50 = {ratio:.2f}; pool exec/s / pool spawn exec/s = {speedup:.2f}; "
              f"first run (warm-up of {a.concurrency} slots) pool {1000 * rows['pool'][2]:.0f} ms, "
              f"pool spawn {1000 * rows['pool spawn'][2]:.0f} ms")


if __name__ == "__main__":
    main()
