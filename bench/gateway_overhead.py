"""Gateway overhead: rollout tokens/s through the Gateway (HTTP, openai SDK) against calling the Engine actor directly.

Same engine, model, prompts and sampling on both sides, in the same run. Each session is one episode as the
RolloutWorker runs it:
  direct  = render the chat template, tokenize, `engine.generate.remote(prompt_ids, Sampling)` (what rollout did
            before the Gateway)
  gateway = `open_session` -> `AsyncOpenAI(base_url=<gateway>/sessions/<id>/v1).chat.completions.create(...)` over
            HTTP -> `close_session` (the record with token ids, logprobs, mask)
`--sessions` episodes, `--concurrency` at a time, `--max-tokens` each with ignore_eos (equal work on both sides).
Tokens/s = sampled tokens / wall time of all episodes. Also printed: the CPU milliseconds the Gateway's process and
the Engine actor's process (vLLM's front end; its engine core is another process) spent per episode on each side, from
their `time.process_time()` around the measured rounds. One Gateway actor serves every rollout worker, so 1000 / its
ms per episode bounds the episodes per second one Gateway can serve on such a core (`--max-tokens 1` leaves little
besides the per-call work). A warm-up round of each side runs first; then the two
sides are measured alternately (direct, gateway, direct, gateway) and each side's best is reported.

    python bench/gateway_overhead.py                       # SmolLM2-135M, 64 sessions, 32 at a time, 64 tokens
    python bench/gateway_overhead.py --model /path/to/hf --sessions 128
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import time

import ray

from rayrl.actors.engine import EngineActor
from rayrl.actors.gateway import GatewayActor
from rayrl.agent import session_client
from rayrl.cluster import private_token
from rayrl.config import load_config
from rayrl.engine import Sampling
from rayrl.models import resolve_model

TARGET = 0.95  # gateway / direct


def prompts(n: int) -> list[list[dict]]:
    system = "Solve the arithmetic problem. End your reply with the final answer as <answer>NUMBER</answer>."
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"What is {i * 7 % 97} + {i * 13 % 89}?"}]
            for i in range(n)]


async def run_direct(engine, tok, convs, conc: int, max_tokens: int) -> tuple[int, float]:
    slots = asyncio.Semaphore(conc)

    async def one(i, msgs):
        async with slots:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            g = await engine.generate.remote(ids, Sampling(max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
                                             f"direct-{i}-{time.monotonic_ns()}")
            return len(g.token_ids)

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*[one(i, m) for i, m in enumerate(convs)]))
    return n, time.perf_counter() - t0


async def run_gateway(gateway, convs, conc: int, max_tokens: int) -> tuple[int, float]:
    import httpx

    slots = asyncio.Semaphore(conc)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=2 * conc), timeout=600)

    async def one(i, msgs):
        async with slots:
            sid, key, base = await gateway.open_session.remote(f"bench/{i}")
            llm = session_client(base, key, "policy", 600, http)
            await llm.chat.completions.create(messages=msgs, max_tokens=max_tokens, temperature=1.0,
                                              extra_body={"ignore_eos": True})
            rec = await gateway.close_session.remote(sid)
            return sum(rec.loss_mask)

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*[one(i, m) for i, m in enumerate(convs)]))
    dt = time.perf_counter() - t0
    await http.aclose()
    return n, dt


def cpu_s(actor) -> float:
    """CPU seconds the actor's process has used so far (all its threads)."""
    return ray.get(actor.__ray_call__.remote(lambda self: time.process_time()), timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per side, alternating")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    model = resolve_model(a.model)
    cfg = load_config(None, [f"model.path={model}", "gateway.port=0", "engine.max_num_seqs=64"])
    private_token()  # no ~/.ray/auth_token left behind (rayrl.cluster)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    threads = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}}}
    engine = EngineActor.options(num_cpus=1, max_concurrency=1000, **threads).remote(model, cfg.engine,
                                                                                  cfg.model.dtype, 0)
    gateway = None
    try:
        ray.get(engine.start.remote(), timeout=600)
        gateway = GatewayActor.options(num_cpus=0.5, max_concurrency=10000).remote(cfg, model, [engine])
        url = ray.get(gateway.start.remote(), timeout=120)
        tok = AutoTokenizer.from_pretrained(model)
        convs = prompts(a.sessions)
        warm = convs[: a.concurrency]
        asyncio.run(run_direct(engine, tok, warm, a.concurrency, 8))
        asyncio.run(run_gateway(gateway, warm, a.concurrency, 8))
        res: dict[str, list[float]] = {"direct": [], "gateway": []}
        cpu = {f"{side}_{proc}": 0.0 for side in res for proc in ("gateway", "engine")}  # CPU s over the rounds
        for _ in range(a.rounds):
            for side, run in (("direct", lambda: run_direct(engine, tok, convs, a.concurrency, a.max_tokens)),
                              ("gateway", lambda: run_gateway(gateway, convs, a.concurrency, a.max_tokens))):
                g0, e0 = cpu_s(gateway), cpu_s(engine)
                n, dt = asyncio.run(run())
                cpu[f"{side}_gateway"] += cpu_s(gateway) - g0
                cpu[f"{side}_engine"] += cpu_s(engine) - e0
                assert n == a.sessions * a.max_tokens, n
                res[side].append(n / dt)
        direct, through = max(res["direct"]), max(res["gateway"])
        ratio = through / direct
        print(json.dumps({"date": datetime.date.today().isoformat(), "model": os.path.basename(model.rstrip("/")),
                          "sessions": a.sessions, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                          "direct_tok_s": [round(x, 1) for x in res["direct"]],
                          "gateway_tok_s": [round(x, 1) for x in res["gateway"]], "gateway_url": url,
                          "ratio": round(ratio, 3), "target": TARGET, "pass": ratio >= TARGET,
                          **{f"cpu_ms_per_episode_{k}": round(1000 * v / (a.rounds * a.sessions), 2)
                             for k, v in cpu.items()}}))
    finally:
        if gateway is not None:
            ray.kill(gateway)
        ray.get(engine.shutdown.remote(), timeout=60)
        ray.kill(engine)
        ray.shutdown()


if __name__ == "__main__":
    main()
