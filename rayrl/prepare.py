"""Dataset preparation: local copies of hub datasets -> rayrl's row format (verl's), for the ReTool jobs.

    python -m rayrl.prepare dapo-math ~/data/DAPO-Math-17k -o ~/data/dapo_math_17k.parquet
    python -m rayrl.prepare aime2024  ~/data/AIME_2024     -o ~/data/aime_2024.parquet
    (the lead wires the same as `rayrl data prepare ...`)

INPUT is a .parquet / .jsonl / .json file or a folder as `hf download --repo-type dataset` leaves it (its data
files are found recursively). Nothing is downloaded here.

- dapo-math (BytedTsinghua-SIA/DAPO-Math-17k): columns `prompt` (one user message: instruction, blank line,
  question, blank line, "Remember to put your answer ... Answer:"), `reward_model.ground_truth`, `data_source`
  (math_dapo), `ability`, `extra_info.index`. The hub parquet repeats each of its ~17k problems ~100 times:
  duplicates (same question) are dropped unless --keep-duplicates.
- aime2024 (Maxwell-Jia/AIME_2024): columns `ID` ("2024-I-1"), `Problem`, `Solution`, `Answer`.

Like verl's recipe/retool preprocessing, the question is taken out of DAPO's "Answer:" instruction and put
under a tool-use instruction that asks for \\boxed{} (--prompt original keeps DAPO's prompt as it is).
Output rows: `prompt` (chat messages), `reward_model` {ground_truth, style}, `data_source`, `agent_name`,
`extra_info` {index, split, question, source ids}. Rows load with `rayrl.data.load_rows`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from rayrl.data import _plain, _read_records

TOOL_INSTRUCTION = (
    "Solve the following problem step by step. You can run Python code with the code_interpreter tool to "
    "calculate or check your work. Put the final answer in \\boxed{}."
)
DAPO_SOURCE = "math_dapo"
AIME_SOURCE = "aime_2024"


def data_files(path: str) -> list[str]:
    """The data files of a file or a downloaded dataset folder, sorted; raises ValueError when there are none."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is neither a file nor a folder")
    files = sorted(f for ext in ("parquet", "jsonl", "json") for f in glob.glob(os.path.join(path, "**", f"*.{ext}"),
                                                                               recursive=True)
                   if "/." not in f[len(path):])  # skip .cache/ and other hidden folders of hf download
    if not files:
        raise ValueError(f"{path!r} holds no .parquet/.jsonl/.json file")
    return files


def read(path: str) -> Iterator[tuple[str, int, dict]]:
    """(file, row number, record) for every record of every data file under `path`."""
    for f in data_files(path):
        for n, rec in _read_records(f):
            if not isinstance(rec, dict):
                raise ValueError(f"{f} row {n}: expected an object, got {type(rec).__name__}")
            yield f, n, _plain(rec)


def dapo_question(content: str) -> str:
    """The bare problem out of DAPO-Math-17k's prompt (instruction \\n\\n question \\n\\n reminder)."""
    parts = content.split("\n\n")
    if len(parts) >= 3 and parts[0].startswith("Solve the following math problem") and "Answer:" in parts[-1]:
        return "\n\n".join(parts[1:-1]).strip()
    return content.strip()  # not DAPO's template: keep it whole


def _prompt(question: str, instruction: str | None) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{instruction}\n\n{question}" if instruction else question}]


def prepare_dapo(path: str, prompt: str = "tool", dedupe: bool = True, limit: int | None = None) -> list[dict]:
    rows, seen = [], set()
    for f, n, rec in read(path):
        where = f"{f} row {n}"
        msgs = rec.get("prompt")
        gt = (rec.get("reward_model") or {}).get("ground_truth")
        last = msgs[-1] if isinstance(msgs, list) and msgs else None
        if not (isinstance(last, dict) and isinstance(last.get("content"), str)):
            raise ValueError(f"{where}: 'prompt' must be a list of chat messages (is this DAPO-Math-17k?), "
                             f"got columns {sorted(rec)}")
        if gt is None:
            raise ValueError(f"{where}: no reward_model.ground_truth")
        question = dapo_question(msgs[-1]["content"])
        if dedupe:
            if question in seen:
                continue
            seen.add(question)
        extra = dict(rec.get("extra_info") or {})
        rows.append({
            "data_source": rec.get("data_source") or DAPO_SOURCE,
            "prompt": msgs if prompt == "original" else _prompt(question, TOOL_INSTRUCTION),
            "ability": rec.get("ability", "MATH"),
            "reward_model": {"ground_truth": str(gt), "style": "rule"},
            "agent_name": "tool_agent",
            "extra_info": {"index": len(rows), "split": "train", "question": question,
                           "source_index": str(extra.get("index", n))},
        })
        if limit is not None and len(rows) >= limit:
            break
    return rows


def prepare_aime(path: str, prompt: str = "tool", limit: int | None = None) -> list[dict]:
    rows = []
    for f, n, rec in read(path):
        keys = {k.lower(): k for k in rec}  # Problem/Answer in Maxwell-Jia/AIME_2024; problem/answer elsewhere
        if "problem" not in keys or "answer" not in keys:
            raise ValueError(f"{f} row {n}: expected columns Problem and Answer (Maxwell-Jia/AIME_2024), "
                             f"got {sorted(rec)}")
        question = str(rec[keys["problem"]]).strip()
        rows.append({
            "data_source": AIME_SOURCE,
            "prompt": _prompt(question, None if prompt == "original" else TOOL_INSTRUCTION),
            "ability": "MATH",
            "reward_model": {"ground_truth": str(rec[keys["answer"]]).strip(), "style": "rule"},
            "agent_name": "tool_agent",
            "extra_info": {"index": len(rows), "split": "test", "question": question,
                           "id": str(rec.get(keys.get("id", "ID"), n))},
        })
        if limit is not None and len(rows) >= limit:
            break
    return rows


def write(rows: list[dict[str, Any]], out: str) -> None:
    """Rows -> .parquet (pyarrow) or .jsonl, written to a temp file and renamed (no half-written output)."""
    if not rows:
        raise ValueError("no rows to write")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    if out.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    elif out.endswith(".jsonl"):
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"output {out!r} must end in .parquet or .jsonl")
    os.replace(tmp, out)


DATASETS = {"dapo-math": "BytedTsinghua-SIA/DAPO-Math-17k", "aime2024": "Maxwell-Jia/AIME_2024"}


def main(argv: list[str] | None = None) -> int:
    """`prepare DATASET INPUT -o OUTPUT`; returns the exit code (2 for a bad input, with one line saying why)."""
    p = argparse.ArgumentParser(prog="rayrl data prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=sorted(DATASETS), help="; ".join(f"{k}: {v}" for k, v in DATASETS.items()))
    p.add_argument("input", help="a .parquet/.jsonl/.json file, or the folder `hf download` wrote")
    p.add_argument("-o", "--output", required=True, help="output .parquet or .jsonl")
    p.add_argument("--prompt", choices=["tool", "original"], default="tool",
                   help="tool: the bare question under a code-tool instruction asking for \\boxed{} (default); "
                        "original: the dataset's own prompt")
    p.add_argument("--keep-duplicates", action="store_true", help="dapo-math: keep repeated questions")
    p.add_argument("--limit", type=int, default=None, help="write at most this many rows")
    args = p.parse_args(argv)
    try:
        if args.dataset == "dapo-math":
            rows = prepare_dapo(args.input, args.prompt, not args.keep_duplicates, args.limit)
        else:
            rows = prepare_aime(args.input, args.prompt, args.limit)
        write(rows, args.output)
    except (ValueError, OSError) as e:
        print(f"rayrl data prepare: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.output}")  # CLI output
    return 0


if __name__ == "__main__":
    sys.exit(main())
