"""SFT traces for the cold start: multi-turn code-interpreter conversations in verl's multi-turn SFT layout.

    python -m rayrl.prepare tool-traces -o outputs/data/tool_traces.parquet \\
        --val-output outputs/data/tool_traces_val.parquet
    python -m rayrl.prepare retool-sft ~/data/ReTool-SFT -o ~/data/retool_sft.parquet

- `tool_traces`: reasoning-gym questions that a one-line Python program answers (TASKS). The assistant writes the
  program in a code_interpreter call; the local sandbox (SandboxPool, backend local) runs it exactly as the tool
  agent would at RL time (`clean_code`, then `format_result` and `truncate` with the agent's defaults) and its
  output is the `tool` message; the assistant then boxes the answer. Rows whose final message does not score 1.0
  with reasoning-gym's `score_answer` are dropped. Most rows make one call; MIX of them check the result with a
  second call, or make a failing first call (a typo, a missing import) and a corrected second one. The system and
  user messages are what the tool agent sends at RL time for the task (its SYSTEM_PROMPT, then the question).
- `retool_sft`: a local copy of JoeYing/ReTool-SFT (the recipe's SFT data: a user message with "*user question:*",
  one assistant message with <code>...</code>, <interpreter>...</interpreter> and <answer>...</answer>) converted as
  verl's recipe/retool/retool_sft_preprocess.py does (user message only, no system prompt; the first ```python
  block of a <code> is the code), in the same layout.

Row layout:
    messages      [system, user, assistant {content, tool_calls: [{id, type: function, function: {name:
                  code_interpreter, arguments: '{"code": ...}'}}]}, tool {tool_call_id, content}, ..., assistant]
                  (arguments as a JSON string, OpenAI's form; verl's preprocess writes a dict: templates take both)
    tools         [rayrl.agents.tool_agent.CODE_INTERPRETER]
    tool-traces rows also carry the RL/held-out scoring columns of rayrl.data.load_rows: `prompt` (the user message:
    the tool agent adds its system prompt), `data_source` (reasoning_gym/<task>), `reward_model.ground_truth`,
    `agent_name`, `extra_info` {index, split, task, kind, question}.
Parquet fills the keys a message does not set with nulls (a system message has tool_calls: null): drop them when read.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Callable
from typing import Any

from rayrl.agents.tool_agent import CODE_INTERPRETER, SYSTEM_PROMPT, Settings, clean_code, format_result, truncate

# task -> (the program that answers an entry, its value as an expression for the check call)
_Program = Callable[[dict], tuple[str, str]]


def _expression(entry: dict) -> tuple[str, str]:
    expr = entry["metadata"]["expression"]
    # reasoning-gym's divisions come out whole, but Python prints 4 / 2 as 2.0: round to the integer answer
    value = f"round({expr})" if "/" in expr else expr
    return f"print({value})", value


def _math(fn: str) -> _Program:
    def program(entry: dict) -> tuple[str, str]:
        value = f"math.{fn}({', '.join(str(x) for x in entry['metadata']['numbers'])})"
        return f"import math\nprint({value})", value
    return program


TASKS: dict[str, _Program] = {
    "basic_arithmetic": _expression,
    "chain_sum": _expression,
    "products": _expression,
    "gcd": _math("gcd"),
    "lcm": _math("lcm"),
}
DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "gcd", "lcm")
MIX = {"two_calls": 0.15, "fixed_error": 0.15}  # the rest: one call

START = "Let me compute it with Python."
CHECK = "Let me check the result."
FIX = "The code failed. Let me fix it."


def _final(answer: str, checked: bool) -> str:
    return ("The check passed. " if checked else "") + f"The answer is \\boxed{{{answer}}}."


def _broken(code: str) -> str:
    """The program with a mistake that raises: the import left out, or a typo in print."""
    if code.startswith("import math\n"):
        return code.removeprefix("import math\n")
    return code.replace("print(", "prnt(", 1)


def _call(k: int, content: str, code: str) -> list[dict]:
    return [{"role": "assistant", "content": content, "tool_calls": [{
        "id": f"call_{k}", "type": "function",
        "function": {"name": "code_interpreter", "arguments": json.dumps({"code": code}, ensure_ascii=False)}}]}]


async def _tool(pool: Any, k: int, code: str) -> tuple[dict, Any]:
    """The code run as the tool agent runs it; its `tool` message and the ExecResult."""
    s = Settings()
    result = await pool.run(clean_code(code), "python")
    text = truncate(format_result(result), s.max_tool_response_length, s.tool_response_truncate_side)
    return {"role": "tool", "tool_call_id": f"call_{k}", "content": text}, result


async def _trace(pool: Any, task: str, entry: dict, kind: str) -> list[dict] | None:
    """The assistant/tool turns for one entry, or None when a run did not go as planned."""
    code, value = TASKS[task](entry)
    turns: list[dict] = []
    k = 0
    if kind == "fixed_error":
        turns += _call(k, START, _broken(code))
        msg, r = await _tool(pool, k, _broken(code))
        if r.error is not None or r.exit_code == 0:
            return None
        turns.append(msg)
        k += 1
    turns += _call(k, FIX if kind == "fixed_error" else START, code)
    msg, r = await _tool(pool, k, code)
    if not r.ok:
        return None
    turns.append(msg)
    answer = r.stdout.strip()
    if kind == "two_calls":
        k += 1
        check = code.replace(f"print({value})", f"print({value} == {answer})")
        turns += _call(k, CHECK, check)
        msg, r = await _tool(pool, k, check)
        if not r.ok or r.stdout.strip() != "True":
            return None
        turns.append(msg)
    turns.append({"role": "assistant", "content": _final(answer, kind == "two_calls")})
    return turns


def tool_traces(tasks: list[str], n: int, seed: int, split: str = "train",
                exclude: set[str] | None = None) -> list[dict]:
    """`n` rows spread evenly over `tasks` (reasoning-gym generators seeded with `seed`), each question once and
    none of `exclude`. Raises ValueError for an unknown task or when too few rows score 1.0."""
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks {','.join(tasks)}: tasks must be some of {', '.join(TASKS)}")
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    return asyncio.run(_tool_traces(tasks, n, seed, split, set(exclude or ())))


async def _tool_traces(tasks: list[str], n: int, seed: int, split: str, exclude: set[str]) -> list[dict]:
    import reasoning_gym  # heavy

    from rayrl.config import SandboxConfig
    from rayrl.rewards import score_reasoning_gym
    from rayrl.sandbox import SandboxPool

    rng = random.Random(seed)
    quota = [n // len(tasks) + (i < n % len(tasks)) for i in range(len(tasks))]
    pool = SandboxPool(SandboxConfig(backend="local", max_concurrency=2, timeout=10))
    rows: list[dict] = []
    try:
        for task, want in zip(tasks, quota, strict=True):
            size = 4 * want + 100  # headroom for repeated questions and dropped rows
            data = reasoning_gym.create_dataset(task, size=size, seed=seed)
            picked, seen = [], set(exclude)
            for i in range(size):
                entry = data[i]
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    picked.append(entry)
            kinds = [rng.choices(["one_call", *MIX], [1 - sum(MIX.values()), *MIX.values()])[0] for _ in picked]
            made = 0
            for start in range(0, len(picked), 64):
                batch = list(zip(picked[start:start + 64], kinds[start:start + 64], strict=True))
                turns = await asyncio.gather(*(_trace(pool, task, e, kind) for e, kind in batch))
                for (entry, kind), t in zip(batch, turns, strict=True):
                    if made == want or t is None:
                        continue
                    source = f"reasoning_gym/{task}"
                    if score_reasoning_gym(source, t[-1]["content"], entry["answer"], {"entry": entry}) != 1.0:
                        continue
                    question = entry["question"]
                    rows.append({
                        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                     {"role": "user", "content": question}, *t],
                        "tools": [CODE_INTERPRETER],
                        "prompt": [{"role": "user", "content": question}],
                        "data_source": source,
                        "reward_model": {"ground_truth": entry["answer"], "style": "rule"},
                        "agent_name": "tool_agent",
                        "extra_info": {"index": len(rows), "split": split, "task": task, "kind": kind,
                                       "question": question},
                    })
                    made += 1
                if made == want:
                    break
            if made < want:
                raise ValueError(f"{task}: only {made} of {want} traces scored 1.0 (seed {seed})")
    finally:
        await pool.close()
    return rows


# --- ReTool-SFT ----------------------------------------------------------------------------------

_FENCE = re.compile(r"```python(.*?)```", re.DOTALL)  # retool_sft_preprocess.py's pattern
_QUESTION = "*user question:*"


def _cut(text: str, start: str, stop: str, where: str) -> tuple[str, str, str] | None:
    """(before, inside, after) of the first start...stop, or None when `start` is not in `text`."""
    i = text.find(start)
    if i == -1:
        return None
    j = text.find(stop, i + len(start))
    if j == -1:
        raise ValueError(f"{where}: {start} without {stop}")
    return text[:i], text[i + len(start):j], text[j + len(stop):]


def retool_sft_row(raw: Any, where: str) -> list[dict]:
    """One ReTool-SFT record -> messages (user, assistant/tool turns, final assistant), as verl's preprocess."""
    msgs = raw.get("messages") if isinstance(raw, dict) else None
    if not (isinstance(msgs, list) and len(msgs) >= 2 and all(isinstance(m, dict) for m in msgs[:2])
            and isinstance(msgs[0].get("content"), str) and isinstance(msgs[1].get("content"), str)):
        raise ValueError(f"{where}: expected `messages` with a user and an assistant message (is this ReTool-SFT?)")
    prompt = msgs[0]["content"]
    i = prompt.find(_QUESTION)
    if i == -1:
        raise ValueError(f"{where}: the user message has no {_QUESTION!r}")
    question = prompt[i + len(_QUESTION):].replace("<answer>", "").replace("</answer>", "").strip()
    out: list[dict] = [{"role": "user", "content": question}]
    rest, k = msgs[1]["content"], 0
    while rest:
        code = _cut(rest, "<code>", "</code>", where)
        if code is not None:
            before, body, rest = code
            fenced = _FENCE.findall(body)
            out += _call(k, before.strip(), fenced[0].strip() if fenced else body)
            tool = _cut(rest, "<interpreter>", "</interpreter>", where)
            if tool is None:
                raise ValueError(f"{where}: <code> block {k + 1} has no <interpreter> output after it")
            _, body, rest = tool
            out.append({"role": "tool", "tool_call_id": f"call_{k}", "content": body.strip()})
            k += 1
            continue
        answer = _cut(rest, "<answer>", "</answer>", where)
        if answer is None:
            raise ValueError(f"{where}: assistant text without <code> or <answer>: {rest[:60]!r}")
        before, body, rest = answer
        out.append({"role": "assistant", "content": (before + body).strip()})
        if rest.strip():
            raise ValueError(f"{where}: text after </answer>: {rest.strip()[:60]!r}")
        break
    if out[-1]["role"] != "assistant" or out[-1].get("tool_calls"):
        raise ValueError(f"{where}: the assistant message does not end with an <answer>")
    return out


def retool_sft(path: str, limit: int | None = None) -> list[dict]:
    """The records of a local ReTool-SFT copy (a file or an `hf download` folder) -> rows; ValueError names file
    and row of a bad record."""
    from rayrl.prepare import read

    rows = []
    for f, n, rec in read(path):
        rows.append({"messages": retool_sft_row(rec, f"{f} row {n}"), "tools": [CODE_INTERPRETER],
                     "data_source": "retool_sft", "extra_info": {"index": len(rows), "source_row": n}})
        if limit is not None and len(rows) >= limit:
            break
    return rows
