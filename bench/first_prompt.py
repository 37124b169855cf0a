"""The Gateway's first-turn prompt: render + encode per session, with the cache of recent first prompts
(`Sessions.encode_first`) against encoding every one (the peer, rayrl before it), in the same run.

The real `rayrl.sessions.Sessions` over SmolLM2's tokenizer with rayrl's hermes template (the GPU async job's), the
tool agent's first request (its system prompt, the question, the code_interpreter schema). `--tasks` distinct
questions, `--n` sessions each (rollout.n: a GRPO group), in the order the queue hands them out (a task's n samples
together); both sides alternate, `--rounds` each after a warm-up round, best round reported.

    python bench/first_prompt.py                      # 64 tasks x 8 samples (the GPU job's batch: 32 x 8, twice)
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

from rayrl.agents.tool_agent import CODE_INTERPRETER, SYSTEM_PROMPT
from rayrl.chat import normalize_messages
from rayrl.models import resolve_model
from rayrl.sessions import Sessions
from rayrl.templates import tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="sessions per task (rollout.n)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tok = tokenizer(resolve_model(a.model), "hermes")
    requests = [normalize_messages([{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": f"What is {i} * {7 * i + 3} - {i % 9}? "
                                                                "Answer in \\boxed{}."}])
                for i in range(a.tasks) for _ in range(a.n)]
    best: dict[str, float] = {}
    ids: dict[str, list] = {}
    for rnd in range(a.rounds + 1):
        for name, keep in (("encode every prompt", 0), ("cache of recent first prompts", 1024)):
            ss = Sessions(tok, max_model_len=1 << 20, first_prompts=keep)
            t0 = time.perf_counter()
            ids[name] = [ss.prompt_ids(None, m, [CODE_INTERPRETER]) for m in requests]
            ms = 1000 * (time.perf_counter() - t0) / len(requests)
            if rnd:
                best[name] = min(best.get(name, ms), ms)
    assert ids["encode every prompt"] == ids["cache of recent first prompts"], "the cache changed a prompt's ids"
    print(f"{datetime.date.today()}: {a.tasks} tasks x {a.n} sessions, first prompt "
          f"{len(ids['encode every prompt'][0])} tokens; best of {a.rounds} rounds; {os.cpu_count()} cores")
    for name, ms in best.items():
        print(f"{name:>30}: {ms:.3f} ms per first prompt")
    peer, mine = best["encode every prompt"], best["cache of recent first prompts"]
    print(f"cached / every prompt: {mine / peer:.2f}x the time (ids identical)")


if __name__ == "__main__":
    main()
