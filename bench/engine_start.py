"""A CPU vLLM engine's start: the model worker inside the EngineCore process (vLLM's uni executor, what rayrl's CPU
engines use since they set VLLM_ENABLE_V1_MULTIPROCESSING=0) against the CPU platform's default, a worker process of
its own (the peer: rayrl before it), in the same run.

The real `rayrl.engine.Engine` (vLLM backend, the CI's engine settings) over `--model`, in a fresh process per start
(the imports are part of the cost), the two sides alternating for `--rounds`. Each start is timed from the process's
first line to the engine's readiness, then one greedy 16-token generation (the same tokens on both sides, checked).

    python bench/engine_start.py                      # SmolLM2-135M, 3 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()
SIDES = {"own worker process (peer)": "1", "worker in the EngineCore": "0"}  # VLLM_ENABLE_V1_MULTIPROCESSING


async def child(model: str) -> dict:
    from rayrl.config import EngineConfig
    from rayrl.engine import Engine, Sampling

    t_import = time.perf_counter()
    engine = Engine(model, EngineConfig(kv_cache_gb=1, max_model_len=1024))
    await engine.start()
    t_ready = time.perf_counter()
    gen = await engine.generate([1, 2, 3, 4], Sampling(max_tokens=16, temperature=0.0, ignore_eos=True))
    t_gen = time.perf_counter()
    await engine.shutdown()
    return {"ready_s": t_ready - T0, "rayrl_import_s": t_import - T0, "first_generate_s": t_gen - t_ready,
            "token_ids": gen.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from rayrl.models import resolve_model

    model = resolve_model(a.model)
    if a.child:
        print("RESULT " + json.dumps(asyncio.run(child(model))), flush=True)
        return
    times: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(a.rounds):
        for side, flag in SIDES.items():
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": flag}
            out = subprocess.run([sys.executable, __file__, "--child", "--model", model], env=env,
                                 capture_output=True, text=True, timeout=600)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"engine_start: {side}: no result (exit {out.returncode}):\n{out.stderr[-3000:]}")
            times[side].append(json.loads(line[7:]))
            print(f"round {r + 1}: {side}: {times[side][-1]}", flush=True)
    peer = statistics.median(t["ready_s"] for t in times[next(iter(SIDES))])
    print(f"\n{datetime.date.today()}  {a.model}, {os.cpu_count()} cores, median of {a.rounds}")
    print("| engine start | ready after s (median, range) | vs peer | first 16 tokens s |")
    print("|---|---|---|---|")
    for side, ts in times.items():
        ready = [t["ready_s"] for t in ts]
        med = statistics.median(ready)
        print(f"| {side} | {med:.1f} ({min(ready):.1f}-{max(ready):.1f}) | {med / peer:.2f}x | "
              f"{statistics.median(t['first_generate_s'] for t in ts):.2f} |")
    outputs = {json.dumps(t["token_ids"]) for ts in times.values() for t in ts}
    print(f"greedy tokens of every start {'the same' if len(outputs) == 1 else 'DIFFER'}: {sorted(outputs)}")


if __name__ == "__main__":
    main()
