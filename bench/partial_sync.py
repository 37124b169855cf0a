"""What a weight update in the middle of generation costs the engine, by what it does with the KV cache the old
weights computed (`engine.keep_kv_on_sync`), in the same run:

- `recompute` (partial rollouts, the default): running requests stop at a token boundary and are sent again over
  their tokens, so prompt + sampled tokens are prefilled again after every update;
- `keep`: they pause in place and continue over the old KV (PipelineRL's in-flight update);
- `wait` (`engine.partial_rollout=false`): the update waits for the running requests to end. The floor: no update
  lands during the batch at all.

One rayrl `Engine` (real vLLM), `--requests` requests of `--prompt-len` random tokens (no shared prefixes), each
sampling exactly `--response-len` tokens, while the driver sends the same weights (object store) as a new version
every `--every` seconds. Each mode runs in its own process, `--repeat` times, alternating. Per run: the batch's wall
time, generated tokens/s, updates that landed during the batch and their seconds (pause or stop + load + reset),
and each request's policy-version span.

    python bench/partial_sync.py                                   # SmolLM2-135M on this CPU
    python bench/partial_sync.py --model /tmp/qwen3-4b --dtype bfloat16 --gpu-mem 0.8 \\
        --requests 64 --prompt-len 2048 --response-len 4096 --every 20                # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import time

MODES = {"recompute": {"partial_rollout": True, "keep_kv_on_sync": False},
         "keep": {"partial_rollout": True, "keep_kv_on_sync": True},
         "wait": {"partial_rollout": False, "keep_kv_on_sync": False}}


async def one_run(a) -> dict:
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from rayrl.config import EngineConfig
    from rayrl.engine import Engine, Sampling
    from rayrl.models import resolve_model
    from rayrl.weight_sync.object_store import pack

    path = resolve_model(a.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype))
    tied = model.config.tie_word_embeddings
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    packet = pack(state, 0)  # the same weights each time, as a new version: every mode loads the same bytes
    del model
    cfg = EngineConfig(max_model_len=a.prompt_len + a.response_len + 16, max_num_seqs=a.requests,
                       gpus_per_engine=1.0 if a.gpu_mem else 0.0, gpu_memory_utilization=a.gpu_mem or 0.5,
                       enforce_eager=not a.gpu_mem, kv_cache_gb=a.kv_cache_gb, request_timeout=a.deadline,
                       **MODES[a.one])
    eng = Engine(path, cfg, dtype=a.dtype)
    await eng.start()
    try:
        await eng.generate([11, 12, 13], Sampling(max_tokens=8, ignore_eos=True), "warm")
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 10000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
        t0 = time.perf_counter()
        reqs = [asyncio.ensure_future(eng.generate(p, Sampling(max_tokens=a.response_len, ignore_eos=True), f"r{i}"))
                for i, p in enumerate(prompts)]
        ends: list[float] = []
        for r in reqs:
            r.add_done_callback(lambda _: ends.append(time.perf_counter()))
        syncs = []  # (start, seconds) of each update
        while not all(r.done() for r in reqs):
            done, _ = await asyncio.wait(reqs, timeout=a.every, return_when=asyncio.ALL_COMPLETED)
            if len(done) < len(reqs):
                packet.version += 1
                start = time.perf_counter()
                syncs.append((start, await eng.receive_weights("object_store", packet, packet.version)))
        wall = max(ends) - t0
        syncs = [s for t, s in syncs if t < max(ends)]  # (`wait`: an update that waited for the batch is not in it)
        gens = [r.result() for r in reqs if r.exception() is None]  # the rest ran past --deadline
    finally:
        await eng.shutdown()
    spans = [max(g.versions) - min(g.versions) for g in gens]
    return {"mode": a.one, "finished": len(gens), "wall_s": wall, "tok_s": sum(len(g.token_ids) for g in gens) / wall,
            "syncs": len(syncs), "sync_s_mean": statistics.mean(syncs) if syncs else 0.0,
            "preemptions": eng.preemptions, "version_span_mean": statistics.mean(spans) if spans else None}


def _range(values: list, fmt: str) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    return f"{min(v):{fmt}}-{max(v):{fmt}}" if min(v) != max(v) else f"{v[0]:{fmt}}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gpu-mem", type=float, default=0.0, help="vLLM's gpu_memory_utilization; 0 = the CPU engine")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="the CPU engine's KV cache")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--every", type=float, default=20.0, help="seconds between weight updates")
    p.add_argument("--modes", default="recompute,keep,wait")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds a request may take (then it counts as not "
                   "finished: updates that come faster than the batch is prefilled again stop all progress)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    p.add_argument("--one", choices=sorted(MODES), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print("ROW " + json.dumps(asyncio.run(one_run(a))), flush=True)
        return
    args = [x for x in sys.argv[1:] if not x.startswith("--out") and x != a.out]
    rows = []
    for _ in range(a.repeat):
        for mode in a.modes.split(","):
            out = subprocess.run([sys.executable, __file__, *args, "--one", mode], capture_output=True, text=True,
                                 timeout=1800)
            row = next((json.loads(x[4:]) for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
            if row is None:
                sys.exit(f"partial_sync: mode {mode} failed:\n{out.stderr[-3000:]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{a.requests} requests x ({a.prompt_len} prompt + {a.response_len} sampled) tokens, "
          f"an update every {a.every:g} s; {a.repeat} runs a mode, alternating")
    print("| mode | requests finished | wall s | tokens/s | updates in the batch | s per update | version span |")
    print("|---|---|---|---|---|---|---|")
    by = {m: [r for r in rows if r["mode"] == m] for m in a.modes.split(",")}
    for m, rs in by.items():
        cols = [_range([r[k] for r in rs], f) for k, f in (("finished", "d"), ("wall_s", ".1f"), ("tok_s", ".0f"),
                                                          ("syncs", "d"), ("sync_s_mean", ".2f"),
                                                          ("version_span_mean", ".2f"))]
        cols[0] += f"/{a.requests}"
        print(f"| {m} | {' | '.join(cols)} |")
    if "keep" in by and "recompute" in by:
        if all(r["finished"] == a.requests for r in by["keep"] + by["recompute"]):
            med = {m: statistics.median(r["wall_s"] for r in by[m]) for m in ("keep", "recompute")}
            print(f"keep / recompute, median wall: {med['keep'] / med['recompute']:.2f}x")
        else:
            print(f"not every request finished within --deadline {a.deadline:g} s: no wall ratio")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "args": vars(a), "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
