"""Dataset preparation: local copies of hub datasets -> rayrl's row format (verl's), for the ReTool jobs.

    python -m rayrl.prepare dapo-math ~/data/DAPO-Math-17k -o ~/data/dapo_math_17k.parquet
    python -m rayrl.prepare aime2024  ~/data/AIME_2024     -o ~/data/aime_2024.parquet
    python -m rayrl.prepare aime2025  ~/data/aime_2025     -o ~/data/aime_2025.parquet
    python -m rayrl.prepare tool-traces -o outputs/data/tool_traces.parquet [--tasks ...] [--n N] [--seed S]
    python -m rayrl.prepare retool-sft  ~/data/ReTool-SFT  -o ~/data/retool_sft.parquet   (both: rayrl/traces.py)
    (the lead wires the same as `rayrl data prepare ...`)

INPUT is a .parquet / .jsonl / .json file or a folder as `hf download --repo-type dataset` leaves it (its data
files are found recursively). Nothing is downloaded here.

- dapo-math (BytedTsinghua-SIA/DAPO-Math-17k): columns `prompt` (one user message: instruction, blank line,
  question, blank line, "Remember to put your answer ... Answer:"), `reward_model.ground_truth`, `data_source`
  (math_dapo), `ability`, `extra_info.index`. The hub parquet repeats each of its ~17k problems ~100 times:
  duplicates (same question) are dropped unless --keep-duplicates.
- aime2024 (Maxwell-Jia/AIME_2024): columns `ID` ("2024-I-1"), `Problem`, `Solution`, `Answer`.
- aime2025 (yentinglin/aime_2025): columns `id`, `problem`, `answer` (any capitalisation is accepted for both).

The prompts are verl v0.6.1 recipe/retool's (`CustomRLHFDataset`): a DAPO row keeps DAPO's own prompt (its
"Answer:" instruction included) with ANSWER_FORMAT appended; an AIME row is the problem with ANSWER_FORMAT
appended, data_source aime_2024 / aime_2025 (--prompt original: DAPO's prompt unchanged, the bare problem).
The recipe trains on every row of the hub file; rayrl drops the repeats unless --keep-duplicates.
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

ANSWER_FORMAT = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"  # recipe/retool's answer_format
DAPO_SOURCE = "math_dapo"
AIME_SOURCES = {"aime2024": "aime_2024", "aime2025": "aime_2025"}  # the recipe's data_source names


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


def prepare_dapo(path: str, prompt: str = "recipe", dedupe: bool = True, limit: int | None = None) -> list[dict]:
    """DAPO-Math-17k records -> rows; prompt "recipe": the first message's content + ANSWER_FORMAT, as the recipe's
    CustomRLHFDataset.map_fn2 does; "original": the prompt unchanged."""
    rows, seen = [], set()
    for f, n, rec in read(path):
        where = f"{f} row {n}"
        msgs = rec.get("prompt")
        gt = (rec.get("reward_model") or {}).get("ground_truth")
        first = msgs[0] if isinstance(msgs, list) and msgs else None
        if not (isinstance(first, dict) and isinstance(first.get("content"), str)):
            raise ValueError(f"{where}: 'prompt' must be a list of chat messages (is this DAPO-Math-17k?), "
                             f"got columns {sorted(rec)}")
        if gt is None:
            raise ValueError(f"{where}: no reward_model.ground_truth")
        question = dapo_question(msgs[0]["content"])
        if dedupe:
            if question in seen:
                continue
            seen.add(question)
        extra = dict(rec.get("extra_info") or {})
        if prompt != "original":
            msgs = [{**msgs[0], "content": msgs[0]["content"] + ANSWER_FORMAT}, *msgs[1:]]
        rows.append({
            "data_source": rec.get("data_source") or DAPO_SOURCE,
            "prompt": msgs,
            "ability": rec.get("ability", "MATH"),
            "reward_model": {"ground_truth": str(gt), "style": (rec.get("reward_model") or {}).get("style", "rule")},
            "agent_name": "tool_agent",
            "extra_info": {"index": len(rows), "split": "train", "question": question,
                           "source_index": str(extra.get("index", n))},
        })
        if limit is not None and len(rows) >= limit:
            break
    return rows


def prepare_aime(path: str, prompt: str = "recipe", limit: int | None = None, source: str = "aime_2024") -> list[dict]:
    """AIME records (Problem/Answer columns, any case) -> rows of data_source `source`; prompt "recipe": the problem +
    ANSWER_FORMAT, as the recipe's CustomRLHFDataset.map_fn does; "original": the bare problem."""
    rows = []
    for f, n, rec in read(path):
        keys = {k.lower(): k for k in rec}  # Problem/Answer in Maxwell-Jia/AIME_2024; problem/answer elsewhere
        if "problem" not in keys or "answer" not in keys:
            raise ValueError(f"{f} row {n}: expected columns Problem and Answer (Maxwell-Jia/AIME_2024, "
                             f"yentinglin/aime_2025), got {sorted(rec)}")
        question = str(rec[keys["problem"]])
        rows.append({
            "data_source": source,
            "prompt": [{"role": "user", "content": question if prompt == "original" else question + ANSWER_FORMAT}],
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


DATASETS = {"dapo-math": "BytedTsinghua-SIA/DAPO-Math-17k", "aime2024": "Maxwell-Jia/AIME_2024",
            "aime2025": "yentinglin/aime_2025"}


def main(argv: list[str] | None = None) -> int:
    """`prepare DATASET INPUT -o OUTPUT`; returns the exit code (2 for a bad input, with one line saying why)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SFT_DATASETS:
        return sft_main(argv)
    p = argparse.ArgumentParser(prog="rayrl data prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=sorted(DATASETS), help="; ".join(f"{k}: {v}" for k, v in DATASETS.items()))
    p.add_argument("input", help="a .parquet/.jsonl/.json file, or the folder `hf download` wrote")
    p.add_argument("-o", "--output", required=True, help="output .parquet or .jsonl")
    p.add_argument("--prompt", choices=["recipe", "original"], default="recipe",
                   help="recipe: verl recipe/retool's prompt, the dataset's + its \\boxed{} answer format (default); "
                        "original: the dataset's own prompt")
    p.add_argument("--keep-duplicates", action="store_true", help="dapo-math: keep repeated questions")
    p.add_argument("--limit", type=int, default=None, help="write at most this many rows")
    args = p.parse_args(argv)
    try:
        if args.dataset == "dapo-math":
            rows = prepare_dapo(args.input, args.prompt, not args.keep_duplicates, args.limit)
        else:
            rows = prepare_aime(args.input, args.prompt, args.limit, AIME_SOURCES[args.dataset])
        write(rows, args.output)
    except (ValueError, OSError) as e:
        print(f"rayrl data prepare: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.output}")  # CLI output
    return 0


SFT_DATASETS = {"tool-traces": "reasoning-gym code-interpreter traces made here (rayrl/traces.py)",
                "retool-sft": "a local copy of JoeYing/ReTool-SFT"}


def sft_main(argv: list[str]) -> int:
    """`prepare tool-traces [-o OUT] ...` / `prepare retool-sft INPUT -o OUT`: multi-turn SFT rows (rayrl.traces)."""
    from rayrl import traces  # reasoning-gym and the sandbox only for these

    p = argparse.ArgumentParser(prog="rayrl data prepare", description=traces.__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="dataset", required=True)
    t = sub.add_parser("tool-traces", help=SFT_DATASETS["tool-traces"])
    t.add_argument("-o", "--output", default="outputs/data/tool_traces.parquet", help="output .parquet or .jsonl")
    t.add_argument("--tasks", default=",".join(traces.DEFAULT_TASKS),
                   help=f"comma-separated reasoning-gym tasks, of: {', '.join(traces.TASKS)}")
    t.add_argument("--n", type=int, default=2000, help="rows, spread evenly over the tasks")
    t.add_argument("--seed", type=int, default=0, help="seed of the reasoning-gym generators and of the mix")
    t.add_argument("--val-output", default=None, help="also write a held-out set here (questions not in OUTPUT)")
    t.add_argument("--val-n", type=int, default=200, help="rows of the held-out set")
    r = sub.add_parser("retool-sft", help=SFT_DATASETS["retool-sft"])
    r.add_argument("input", help="a .parquet/.jsonl/.json file, or the folder `hf download` wrote")
    r.add_argument("-o", "--output", required=True, help="output .parquet or .jsonl")
    r.add_argument("--limit", type=int, default=None, help="write at most this many rows")
    args = p.parse_args(argv)
    try:
        if args.dataset == "retool-sft":
            outputs = [(traces.retool_sft(args.input, args.limit), args.output)]
        else:
            tasks = [x.strip() for x in args.tasks.split(",") if x.strip()]
            rows = traces.tool_traces(tasks, args.n, args.seed)
            outputs = [(rows, args.output)]
            if args.val_output:
                seen = {row["extra_info"]["question"] for row in rows}
                # reasoning-gym seeds item i with seed + i: a seed far away draws other questions
                val = traces.tool_traces(tasks, args.val_n, args.seed + 1_000_000, "test", seen)
                outputs.append((val, args.val_output))
        for rows, out in outputs:
            write(rows, out)
    except (ValueError, OSError) as e:
        print(f"rayrl data prepare: {e}", file=sys.stderr)
        return 2
    for rows, out in outputs:
        print(f"wrote {len(rows)} rows to {out}")  # CLI output
    return 0


if __name__ == "__main__":
    sys.exit(main())
