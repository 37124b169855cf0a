"""Seed 000's before/after comparison: each model answers the same held-out prompts through the same tool agent.

Each model is served in turn with `rayrl serve` (vLLM's OpenAI server, hermes tool parser), rendering prompts with
the chat template the RL job's Gateway would use for it (`model.chat_template` of `--job`, through
rayrl.templates.tokenizer). `rayrl.agents.tool_agent:agent` runs every episode against that server with the job's
`rollout.agent_config` and a SandboxPool of the job's `sandbox` section, and its answer is scored with the job's
`reward.fn`. Sampling is greedy unless `--temperature` says otherwise.

    python -m examples.before_after.compare --job jobs/retool_tiny.yaml \\
        --model base=smollm2 --model sft=outputs/retool_sft_tiny/hf --model rl=outputs/retool_tiny/hf \\
        --prompts outputs/data/tool_traces_val.parquet --n 40 -o outputs/before_after.json

Prints a table (accuracy, tool-call rate, tool calls, mean model turns, code errors) and writes every episode to -o.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx


@dataclass
class Summary:
    label: str
    model: str
    episodes: int
    accuracy: float  # mean score clipped to [0, 1]; a failed episode counts 0
    tool_call_rate: float  # share of episodes with at least one code_interpreter call run
    tool_calls_mean: float
    turns_mean: float  # model replies per episode
    code_errors: int  # runs that exited non-zero
    failed: int  # episodes that raised (no answer)


def serve(model: str, template_file: str, port: int, log_path: str) -> subprocess.Popen:
    """`rayrl serve` of `model` with the given chat template, once it answers /v1/models (600 s at most)."""
    cmd = [sys.executable, "-m", "rayrl", "serve", model, "--port", str(port), "--served-model-name", "policy",
           "--", "--chat-template", template_file, "--max-model-len", "1024", "--dtype", "float32"]
    log = open(log_path, "w")  # the server's output, for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rayrl serve {model} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop(proc)
    raise TimeoutError(f"rayrl serve {model} did not answer within 600 s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def episodes(cfg, rows: list, port: int, temperature: float, concurrency: int) -> list[dict]:
    """One tool-agent episode per row against the server on `port`; each scored with the job's reward.fn."""
    from rayrl.agent import TaskContext, session_client
    from rayrl.agents.tool_agent import agent
    from rayrl.rewards import resolve_scorer
    from rayrl.sandbox import SandboxPool
    from rayrl.types import Task

    score = resolve_scorer(cfg.reward.fn)
    config = dict(cfg.rollout.agent_config)
    config["sampling"] = {**config.get("sampling", {}), "temperature": temperature}
    pool = SandboxPool(cfg.sandbox)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, row) -> dict:
        task = Task(task_id=f"p{i}", group_id=f"p{i}", step=0, messages=row.messages, ground_truth=row.ground_truth,
                    data_source=row.data_source, extra_info=row.extra_info)
        llm = session_client(f"http://127.0.0.1:{port}/v1", "none", "policy", timeout=300)
        ctx = TaskContext(task=task, llm=llm, run_config=cfg, sandbox=pool)
        rec = {"prompt": row.messages[-1]["content"], "ground_truth": row.ground_truth}
        async with gate:
            try:
                out = await asyncio.wait_for(agent(ctx, config), 600)
            except Exception as e:  # noqa: BLE001 - an episode that raised counts as failed, not as a crash
                return {**rec, "error": f"{type(e).__name__}: {e}", "score": 0.0}
        meta = out["metadata"]
        meta.pop("events", None)
        s = score(row.data_source, out["answer"], row.ground_truth, {**row.extra_info, "num_turns": meta["num_turns"]})
        return {**rec, "answer": out["answer"], "score": s, **meta}

    try:
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    finally:
        await pool.close()


def summarize(label: str, model: str, recs: list[dict]) -> Summary:
    n = len(recs)
    ok = [r for r in recs if "error" not in r]
    return Summary(label, model, n, sum(min(max(r["score"], 0.0), 1.0) for r in recs) / n,
                   sum(r["tool_calls"] > 0 for r in ok) / n, sum(r["tool_calls"] for r in ok) / n,
                   sum(r["turns"] for r in ok) / max(len(ok), 1), sum(r["code_errors"] for r in ok), n - len(ok))


def table(rows: list[Summary]) -> str:
    lines = ["| model | path | episodes | accuracy | tool-call rate | tool calls / episode | model turns / episode "
             "| code errors | failed |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s.label} | `{s.model}` | {s.episodes} | {s.accuracy:.1%} | {s.tool_call_rate:.1%} | "
              f"{s.tool_calls_mean:.2f} | {s.turns_mean:.2f} | {s.code_errors} | {s.failed} |" for s in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default="jobs/retool_tiny.yaml", help="the RL job: agent_config, sandbox, reward.fn, "
                   "chat template")
    p.add_argument("--model", action="append", required=True, help="LABEL=PATH (a HF folder, or smollm2); repeat")
    p.add_argument("--prompts", required=True, help="held-out rows (.parquet/.jsonl in verl's row format)")
    p.add_argument("--n", type=int, default=40, help="rows of --prompts, spread evenly over the file")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("-o", "--output", default=None, help="a JSON file with the summaries and every episode")
    a = p.parse_args(argv)

    from rayrl.config import load_config
    from rayrl.data import load_rows
    from rayrl.models import resolve_model
    from rayrl.templates import tokenizer

    cfg = load_config(a.job, check_files=False)
    rows = load_rows(a.prompts, 0, 0)
    rows = rows[:: max(len(rows) // a.n, 1)][: a.n]  # tool-traces files list their tasks one after another
    summaries, everything = [], {}
    workdir = tempfile.mkdtemp(prefix="rayrl-before-after-")
    for spec in a.model:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"--model {spec!r}: expected LABEL=PATH")
        model = resolve_model(path)
        template = os.path.join(workdir, f"{label}.jinja")
        with open(template, "w") as f:  # what the RL job's Gateway would render this model's prompts with
            f.write(tokenizer(model, cfg.model.chat_template).chat_template)
        log = os.path.join(workdir, f"{label}.log")
        print(f"{label}: serving {model} (log {log})", flush=True)
        proc = serve(model, template, a.port, log)
        try:
            t0 = time.monotonic()
            recs = asyncio.run(episodes(cfg, rows, a.port, a.temperature, a.concurrency))
        finally:
            stop(proc)
        summaries.append(summarize(label, path, recs))
        everything[label] = recs
        print(f"{label}: {len(recs)} episodes in {time.monotonic() - t0:.0f} s", flush=True)
    print(table(summaries))
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"job": a.job, "prompts": a.prompts, "n": len(rows), "temperature": a.temperature,
                       "summaries": [s.__dict__ for s in summaries], "episodes": everything}, f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
