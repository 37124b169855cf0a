"""rayrl.prepare: small files in the hub schemas -> rows that rayrl.data.load_rows accepts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayrl.data import load_rows
from rayrl.prepare import ANSWER_FORMAT, dapo_question, main

# verl v0.6.1 recipe/retool/retool.py's answer_format, written out here so that a change to ANSWER_FORMAT shows
RECIPE_SUFFIX = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the "
                 "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
                 'Remember to put your answer on its own line after "Answer:".')


def dapo_record(q: str, answer: str, index: str) -> dict:
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(q=q)}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


@pytest.fixture
def dapo_dir(tmp_path):
    # As `hf download` leaves it: data/dapo-math-17k.parquet (+ a hidden cache folder that must be ignored).
    records = [dapo_record("What is $1+1$?\n\nGive an integer.", "2", "a"),
               dapo_record("Find $x$ if $2x=6$.", "3", "b"),
               dapo_record("What is $1+1$?\n\nGive an integer.", "2", "c")]  # the hub file repeats problems
    (tmp_path / "dapo" / "data").mkdir(parents=True)
    (tmp_path / "dapo" / ".cache").mkdir()
    (tmp_path / "dapo" / ".cache" / "junk.json").write_text("not json")
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "dapo" / "data" / "dapo-math-17k.parquet")
    return tmp_path / "dapo"


def test_dapo_to_rows(dapo_dir, tmp_path, capsys) -> None:
    out = tmp_path / "train.parquet"
    assert main(["dapo-math", str(dapo_dir), "-o", str(out)]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out  # the repeated problem is dropped
    rows = load_rows(str(out), size=0, seed=0)
    assert [r.ground_truth for r in rows] == ["2", "3"]
    assert rows[0].data_source == "math_dapo"
    (msg,) = rows[0].messages
    # the recipe's CustomRLHFDataset.map_fn2: DAPO's prompt as it is, the answer format appended
    assert msg == {"role": "user", "content": DAPO_TEMPLATE.format(q="What is $1+1$?\n\nGive an integer.") +
                   RECIPE_SUFFIX}
    assert ANSWER_FORMAT == RECIPE_SUFFIX
    assert rows[0].extra_info["question"] == "What is $1+1$?\n\nGive an integer."
    assert rows[1].extra_info["source_index"] == "b"


def test_dapo_original_prompt_and_options(dapo_dir, tmp_path) -> None:
    out = tmp_path / "train.jsonl"
    assert main(["dapo-math", str(dapo_dir), "-o", str(out), "--prompt", "original", "--keep-duplicates"]) == 0
    rows = load_rows(str(out), size=0, seed=0)
    assert len(rows) == 3 and rows[0].messages[0]["content"] == DAPO_TEMPLATE.format(q="What is $1+1$?\n\nGive an "
                                                                                       "integer.")
    assert main(["dapo-math", str(dapo_dir), "-o", str(out), "--limit", "1"]) == 0
    assert len(load_rows(str(out), size=0, seed=0)) == 1


def test_aime_to_rows(tmp_path) -> None:
    src = tmp_path / "aime_2024_problems.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"ID": "2024-I-1", "Problem": "Every morning Aya walks 9 km ...", "Solution": "...", "Answer": 204},
        {"ID": "2024-II-15", "Problem": "Find the number of rectangles ...", "Solution": "...", "Answer": 315}]), src)
    out = tmp_path / "aime.parquet"
    assert main(["aime2024", str(src), "-o", str(out)]) == 0
    rows = load_rows(str(out), size=0, seed=0)
    assert [r.ground_truth for r in rows] == ["204", "315"]  # strings, as verl's math scorers expect
    assert rows[0].data_source == "aime_2024" and rows[1].extra_info["id"] == "2024-II-15"
    # the recipe's CustomRLHFDataset.map_fn: the problem, then the answer format
    assert rows[0].messages == [{"role": "user", "content": "Every morning Aya walks 9 km ..." + RECIPE_SUFFIX}]
    assert main(["aime2024", str(src), "-o", str(out), "--prompt", "original"]) == 0
    assert load_rows(str(out), size=0, seed=0)[0].messages[0]["content"] == "Every morning Aya walks 9 km ..."


def test_aime2025_rows_are_their_own_source(tmp_path) -> None:
    src = tmp_path / "aime_2025.jsonl"  # yentinglin/aime_2025's columns
    src.write_text(json.dumps({"id": 0, "problem": "Find the sum ...", "answer": "70", "year": 2025}) + "\n")
    out = tmp_path / "out.parquet"
    assert main(["aime2025", str(src), "-o", str(out)]) == 0
    (row,) = load_rows(str(out), size=0, seed=0)
    assert row.data_source == "aime_2025" and row.ground_truth == "70"
    assert row.messages[0]["content"] == "Find the sum ..." + RECIPE_SUFFIX


def test_aime_jsonl_lowercase_columns(tmp_path) -> None:
    src = tmp_path / "aime.jsonl"
    src.write_text(json.dumps({"id": 1, "problem": "P?", "answer": "7"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["aime2024", str(src), "-o", str(out)]) == 0
    assert load_rows(str(out), size=0, seed=0)[0].ground_truth == "7"


def test_wrong_schema_is_a_one_line_error(tmp_path, capsys) -> None:
    src = tmp_path / "x.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    assert main(["aime2024", str(src), "-o", str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err
    assert "x.jsonl row 1: expected columns Problem and Answer" in err
    assert main(["dapo-math", str(tmp_path / "missing"), "-o", str(tmp_path / "o.parquet")]) == 2
    assert not (tmp_path / "o.parquet").exists()


def test_dapo_question_keeps_unknown_templates_whole() -> None:
    assert dapo_question(DAPO_TEMPLATE.format(q="A\n\nB")) == "A\n\nB"
    assert dapo_question("Just a question?") == "Just a question?"
