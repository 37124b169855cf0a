"""The HTTP path between one rollout worker and the Gateway: CPU per LLM call on both sides, with one connection
pool for all of the worker's episodes against rayrl's `ShardedTransport` (a pool per 8 episodes), in the same run.

The Gateway is rayrl's (`rayrl.gateway.Gateway`, uvicorn, its own process as the Gateway actor is); its engine is
a stand-in that answers every call at once with the same tool call (`StandInEngine`), so what is measured is the
HTTP, JSON, openai-SDK, chat-template and session work around an engine call, not an engine. One event loop runs
`--concurrency` episodes at a time, as one rollout worker does; each episode is the tool agent's two calls (a
reply with a code_interpreter call, then the answer after the tool's output) through `rayrl.agent.session_client`.

    python bench/gateway_http.py                    # SmolLM2-135M's tokenizer, 400 episodes, 64 at a time
    python bench/gateway_http.py --concurrency 128 --episodes 800
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import time

import httpx

from rayrl.agents.tool_agent import CODE_INTERPRETER, SYSTEM_PROMPT
from rayrl.models import resolve_model
from rayrl.rollout import ShardedTransport
from rayrl.types import Generation

REPLY = ('Let me compute it.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": '
         '"print(123 * 456 + 789 - 12)"}}\n</tool_call>')


class StandInEngine:
    """Answers `generate.remote(prompt, sampling, request_id)` at once with REPLY's tokens (no model)."""

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    def __init__(self, tok):
        self.ids = tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
        self.generate = self._Method(self._generate)
        self.abort = self._Method(lambda request_id: None)

    async def _generate(self, prompt, sampling, request_id):
        n = len(self.ids)
        return Generation(prompt_ids=prompt, token_ids=self.ids, logprobs=[-0.1] * n, finish_reason="stop",
                          policy_version=0, versions=[0] * n)


def serve(model: str, asks: mp.Queue, answers: mp.Queue) -> None:
    """The Gateway's process: listen, then answer the parent's asks (open sessions, CPU seconds so far, stop)."""
    from rayrl.config import Config
    from rayrl.gateway import Gateway

    async def main():
        cfg = Config()
        cfg.model.chat_template, cfg.gateway.port = "hermes", 0
        gw = Gateway(cfg, model, [])
        gw.engines, gw.load = [StandInEngine(gw.tok)], [0]
        gw._hermes  # noqa: B018 - vLLM's tool parser imports in seconds: before anything is timed
        answers.put(await gw.start())
        while (ask := await asyncio.to_thread(asks.get)) != "stop":
            if ask == "cpu":
                answers.put(time.process_time())
            else:  # a number of sessions
                answers.put([gw.open_session(f"t{i}", budget=384, max_prompt=512) for i in range(ask)])
        await gw.shutdown()

    asyncio.run(main())


async def episodes(transport: httpx.AsyncBaseTransport, sessions: list, concurrency: int) -> None:
    from rayrl.agent import session_client

    http = httpx.AsyncClient(transport=transport, timeout=600)
    slots = asyncio.Semaphore(concurrency)

    async def one(sid, key, base_url):
        async with slots:
            llm = session_client(base_url, key, "policy", 600, http)
            msgs = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "What is 123 * 456 + 789 - 12? Answer in \\boxed{}."}]
            r = await llm.chat.completions.create(messages=msgs, tools=[CODE_INTERPRETER])
            m = r.choices[0].message
            msgs += [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "56877"}]
            await llm.chat.completions.create(messages=msgs, tools=[CODE_INTERPRETER])

    await asyncio.gather(*[one(*s) for s in sessions])
    await http.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="its tokenizer and chat template (hermes) are used")
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=64, help="episodes at once (rollout.concurrency)")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds of each side, alternately")
    ap.add_argument("--out", default=None, help="append the result as a JSON line here")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    asks, answers = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=serve, args=(resolve_model(a.model), asks, answers), daemon=True)
    server.start()
    answers.get(timeout=300)  # the Gateway listens
    sides = {"one pool": lambda: httpx.AsyncHTTPTransport(limits=httpx.Limits(
                 max_connections=None, max_keepalive_connections=2 * a.concurrency)),
             "sharded": lambda: ShardedTransport(a.concurrency)}
    rows: dict[str, list[dict]] = {k: [] for k in sides}
    for rnd in range(a.rounds + 1):  # round 0 warms both sides up, untimed
        for name, transport in sides.items():
            asks.put(a.episodes)
            sessions = answers.get(timeout=60)
            asks.put("cpu")
            g0, c0, t0 = answers.get(timeout=60), time.process_time(), time.perf_counter()
            asyncio.run(episodes(transport(), sessions, a.concurrency))
            wall, client = time.perf_counter() - t0, time.process_time() - c0
            asks.put("cpu")
            gateway = answers.get(timeout=60) - g0
            calls = 2 * a.episodes
            if rnd:
                rows[name].append({"calls_per_s": calls / wall, "client_ms": 1000 * client / calls,
                                   "gateway_ms": 1000 * gateway / calls})
    asks.put("stop")
    server.join(30)
    best = {k: {m: (max if m == "calls_per_s" else min)(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    print(f"{a.episodes} episodes x 2 LLM calls, {a.concurrency} at a time on one event loop; best of {a.rounds}")
    print("| transport | calls/s | worker CPU ms/call | Gateway CPU ms/call |\n|---|---|---|---|")
    for k, b in best.items():
        print(f"| {k} | {b['calls_per_s']:.0f} | {b['client_ms']:.2f} | {b['gateway_ms']:.2f} |")
    one, sh = best["one pool"], best["sharded"]
    print(f"sharded / one pool: calls/s {sh['calls_per_s'] / one['calls_per_s']:.2f}x, worker CPU per call "
          f"{sh['client_ms'] / one['client_ms']:.2f}x, "
          f"Gateway CPU per call {sh['gateway_ms'] / one['gateway_ms']:.2f}x")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "episodes": a.episodes, "concurrency": a.concurrency, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
