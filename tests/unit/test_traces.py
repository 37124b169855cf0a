"""rayrl.traces: tool traces made with the real local sandbox, and ReTool-SFT conversion (a fixture in its raw
format)."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayrl.agents.tool_agent import CODE_INTERPRETER, SYSTEM_PROMPT
from rayrl.data import load_rows
from rayrl.prepare import main
from rayrl.rewards import score_reasoning_gym
from rayrl.traces import retool_sft_row, tool_traces


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    train, val = d / "train.parquet", d / "val.parquet"
    assert main(["tool-traces", "-o", str(train), "--tasks", "basic_arithmetic,gcd", "--n", "60", "--seed", "3",
                 "--val-output", str(val), "--val-n", "10"]) == 0
    return pq.read_table(train).to_pylist(), pq.read_table(val).to_pylist(), val


def _plain(m: dict) -> dict:
    return {k: v for k, v in m.items() if v is not None}  # parquet fills the keys a message does not set


def test_rows_are_multi_turn_sft_conversations(traces) -> None:
    rows, _, _ = traces
    assert len(rows) == 60
    assert Counter(r["extra_info"]["task"] for r in rows) == {"basic_arithmetic": 30, "gcd": 30}
    for r in rows:
        msgs = [_plain(m) for m in r["messages"]]
        assert r["tools"] == [CODE_INTERPRETER]
        # the prompt the tool agent sends at RL time for this task: its system prompt, then the question
        assert msgs[0] == {"role": "system", "content": SYSTEM_PROMPT} and msgs[1]["role"] == "user"
        assert r["prompt"] == [{"role": "user", "content": msgs[1]["content"]}]
        roles = [m["role"] for m in msgs[2:]]
        calls = roles.count("tool")
        assert roles == ["assistant", "tool"] * calls + ["assistant"] and calls >= 1
        for call, tool in zip(msgs[2:-1:2], msgs[3:-1:2], strict=True):
            (tc,) = call["tool_calls"]
            assert tc["function"]["name"] == "code_interpreter" and tool["tool_call_id"] == tc["id"]
            assert set(json.loads(tc["function"]["arguments"])) == {"code"}
        final = msgs[-1]["content"]
        assert "tool_calls" not in msgs[-1] and "\\boxed{" in final
        # what the RL scorer gives this row's final answer (the file row carries no generator entry)
        assert score_reasoning_gym(r["data_source"], final, r["reward_model"]["ground_truth"], r["extra_info"]) == 1.0


def test_mix_and_tool_output_from_the_sandbox(traces) -> None:
    rows, _, _ = traces
    kinds = Counter(r["extra_info"]["kind"] for r in rows)
    assert kinds["one_call"] > kinds["two_calls"] > 0 and kinds["fixed_error"] > 0
    for r in rows:
        msgs = r["messages"]
        answer = msgs[-1]["content"].split("\\boxed{")[1].rstrip("}.")
        tools = [m["content"] for m in msgs if m["role"] == "tool"]
        if r["extra_info"]["kind"] == "fixed_error":
            # the first run really failed in the sandbox; the corrected second printed the answer
            assert "Traceback" in tools[0] and "NameError" in tools[0] and tools[1] == answer
        elif r["extra_info"]["kind"] == "two_calls":
            assert tools == [answer, "True"]
        else:
            assert tools == [answer]


def test_held_out_set_is_disjoint_and_loads_for_rl(traces) -> None:
    rows, val, path = traces
    assert len(val) == 10
    assert not {r["extra_info"]["question"] for r in rows} & {r["extra_info"]["question"] for r in val}
    loaded = load_rows(str(path), size=0, seed=0)
    assert loaded[0].data_source.startswith("reasoning_gym/") and loaded[0].messages[0]["role"] == "user"
    assert {r.extra_info["split"] for r in loaded} == {"test"}


def test_bad_task_is_a_one_line_error(tmp_path, capsys) -> None:
    assert main(["tool-traces", "-o", str(tmp_path / "x.parquet"), "--tasks", "sudoku"]) == 2
    assert "--tasks sudoku: tasks must be some of basic_arithmetic" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--n must be >= 1"):
        tool_traces(["gcd"], 0, 0)


# --- ReTool-SFT: records in JoeYing/ReTool-SFT's raw format --------------------------------------

USER = ("Solve the problem with the code interpreter. Put the final answer in <answer>\\boxed{}</answer>.\n\n"
        "*user question:*\nWhat is $2^{10}$?\n<answer></answer>")  # verl drops the answer tags
ASSISTANT = ("I will compute the power.\n<code>\n```python\nprint(2 ** 10)\n```\n</code>\n"
             "<interpreter>\n1024\n</interpreter>\nNow check it another way.\n<code>x = 1\nfor _ in range(10):\n"
             "    x *= 2\nprint(x)</code>\n<interpreter>1024</interpreter>\nBoth agree.\n"
             "<answer>\\boxed{1024}</answer>")


def record(user: str = USER, assistant: str = ASSISTANT) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def test_retool_sft_conversion_as_verl_preprocess(tmp_path, capsys) -> None:
    src = tmp_path / "ReTool-SFT" / "data"
    src.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([record(), record()]), src / "train-00000-of-00001.parquet")
    out = tmp_path / "sft.parquet"
    assert main(["retool-sft", str(tmp_path / "ReTool-SFT"), "-o", str(out)]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out
    row = pq.read_table(out).to_pylist()[0]
    assert row["tools"] == [CODE_INTERPRETER]
    msgs = [_plain(m) for m in row["messages"]]
    assert msgs[0] == {"role": "user", "content": "What is $2^{10}$?"}
    assert msgs[1]["content"] == "I will compute the power."
    assert json.loads(msgs[1]["tool_calls"][0]["function"]["arguments"]) == {"code": "print(2 ** 10)"}  # fenced
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_0", "content": "1024"}
    code = json.loads(msgs[3]["tool_calls"][0]["function"]["arguments"])["code"]
    assert code == "x = 1\nfor _ in range(10):\n    x *= 2\nprint(x)"  # no fence: the <code> body as it is
    assert msgs[3]["content"] == "Now check it another way." and msgs[4]["tool_call_id"] == "call_1"
    assert msgs[5] == {"role": "assistant", "content": "Both agree.\n\\boxed{1024}"}
    assert len(msgs) == 6


@pytest.mark.parametrize(("rec", "why"), [
    (record(user="no marker here"), "has no '*user question:*'"),
    (record(assistant="<code>print(1)</code> and no output"), "has no <interpreter> output"),
    (record(assistant="<code>print(1)"), "<code> without </code>"),
    (record(assistant="just text"), "without <code> or <answer>"),
    ({"question": "q"}, "expected `messages` with a user and an assistant message"),
])
def test_retool_sft_bad_row_names_file_and_row(tmp_path, capsys, rec, why) -> None:
    src = tmp_path / "retool.jsonl"
    src.write_text(json.dumps(record()) + "\n" + json.dumps(rec) + "\n")
    assert main(["retool-sft", str(src), "-o", str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert "retool.jsonl row 2: " in err and why in err and "\n" not in err
    with pytest.raises(ValueError, match="row 9"):
        retool_sft_row(rec, "f row 9")
