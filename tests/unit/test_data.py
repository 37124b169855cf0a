"""Task sources (reasoning-gym, verl-format jsonl/json/parquet), row validation, DataIterator."""

from __future__ import annotations

import json
import pickle

import pytest

from rayrl.data import DataIterator, Row, load_rows

GYM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _verl_rows(n: int) -> list[dict]:
    return [{"data_source": "math_dapo",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i, "split": "train"},
             "agent_name": "tool_agent"} for i in range(n)]


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_reasoning_gym_rows() -> None:
    rows = load_rows("reasoning_gym:basic_arithmetic", size=5, seed=7, gym_kwargs=GYM, system_prompt="Be brief.")
    assert len(rows) == 5
    r = rows[0]
    assert r.data_source == "reasoning_gym/basic_arithmetic"
    assert r.messages[0] == {"role": "system", "content": "Be brief."}
    assert r.messages[1]["role"] == "user" and r.messages[1]["content"] == r.extra_info["entry"]["question"]
    assert r.ground_truth == r.extra_info["entry"]["answer"] and r.extra_info["index"] == 0
    assert pickle.loads(pickle.dumps(rows)) == rows
    json.dumps(r.extra_info)  # the entry is JSON-able too
    again = load_rows("reasoning_gym:basic_arithmetic", size=5, seed=7, gym_kwargs=GYM, system_prompt="Be brief.")
    assert again == rows  # same seed, same rows
    # the entry scores with reasoning-gym's own scorer
    from rayrl.rewards import resolve_scorer
    score = resolve_scorer("auto")
    assert score(r.data_source, f"<answer>{r.ground_truth}</answer>", r.ground_truth, r.extra_info) == 1.0


def test_reasoning_gym_errors() -> None:
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'no_such_task'"):
        load_rows("reasoning_gym:no_such_task", size=2, seed=0, gym_kwargs={}, system_prompt=None)
    with pytest.raises(ValueError, match="gym_kwargs"):
        load_rows("reasoning_gym:basic_arithmetic", size=2, seed=0, gym_kwargs={"bogus": 1}, system_prompt=None)


def test_jsonl_rows(tmp_path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", _verl_rows(3))
    rows = load_rows(path, size=0, seed=0, gym_kwargs={}, system_prompt="sys")
    want = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 1 + 1?"}]
    assert rows[1] == Row(messages=want,
                          ground_truth="2", data_source="math_dapo", extra_info={"index": 1, "split": "train"})
    # a row that has its own system message keeps it
    rec = _verl_rows(1)[0]
    rec["prompt"].insert(0, {"role": "system", "content": "mine"})
    (row,) = load_rows(_write_jsonl(tmp_path / "own.jsonl", [rec]), 0, 0, {}, "sys")
    assert [m["content"] for m in row.messages] == ["mine", "What is 0 + 0?"]


def test_json_array_rows(tmp_path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(_verl_rows(2)))
    rows = load_rows(str(path), 0, 0, {}, None)
    assert [r.ground_truth for r in rows] == ["0", "2"]
    assert rows[0].messages == [{"role": "user", "content": "What is 0 + 0?"}]


def test_parquet_rows(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _verl_rows(4)
    records[2]["prompt"].insert(0, {"role": "system", "content": "mine"})
    path = str(tmp_path / "data.parquet")
    pq.write_table(pa.Table.from_pylist(records), path)
    rows = load_rows(path, 0, 0, {}, "sys")
    assert len(rows) == 4
    assert rows[0].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 0 + 0?"}]
    assert rows[2].messages[0] == {"role": "system", "content": "mine"} and len(rows[2].messages) == 2
    assert rows[3].ground_truth == "6" and rows[3].extra_info == {"index": 3, "split": "train"}
    assert all(type(m) is dict for r in rows for m in r.messages)  # plain dicts, no numpy/arrow objects


def test_parquet_written_by_pandas(tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    path = str(tmp_path / "pd.parquet")
    pd.DataFrame(_verl_rows(2)).to_parquet(path)
    rows = load_rows(path, 0, 0, {}, None)
    assert rows[1].messages == [{"role": "user", "content": "What is 1 + 1?"}] and rows[1].ground_truth == "2"


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(prompt=[]), "data.jsonl row 3: prompt must be a non-empty list of {role, content} messages"),
    (lambda r: r.update(prompt="hi"), "data.jsonl row 3: prompt must be a non-empty list"),
    (lambda r: r.update(prompt=[{"role": "user"}]), "data.jsonl row 3: prompt must be a non-empty list"),
    (lambda r: r.update(prompt=[{"role": "robot", "content": "x"}]),
     "data.jsonl row 3: prompt message 0 has role 'robot'"),
    (lambda r: r.pop("reward_model"), "data.jsonl row 3: reward_model must be a mapping with a ground_truth"),
    (lambda r: r.update(reward_model={"style": "rule"}),
     "data.jsonl row 3: reward_model must be a mapping with a ground_truth"),
    (lambda r: r.pop("data_source"), "data.jsonl row 3: data_source must be a non-empty string"),
    (lambda r: r.update(extra_info=[1]), "data.jsonl row 3: extra_info must be a mapping"),
])
def test_bad_jsonl_row_names_file_and_row(tmp_path, mutate, message: str) -> None:
    records = _verl_rows(4)
    mutate(records[2])
    path = _write_jsonl(tmp_path / "data.jsonl", records)
    with pytest.raises(ValueError) as info:
        load_rows(path, 0, 0, {}, None)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(tmp_path)) and message in text


def test_bad_json_line_and_bad_parquet_row(tmp_path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(_verl_rows(1)[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl row 3: not valid JSON"):
        load_rows(str(path), 0, 0, {}, None)

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _verl_rows(3)
    records[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(records), str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match=r"d.parquet row 2: reward_model must be a mapping with a ground_truth"):
        load_rows(str(tmp_path / "d.parquet"), 0, 0, {}, None)


def test_unknown_source(tmp_path) -> None:
    with pytest.raises(ValueError, match="must be reasoning_gym:<task> or a .parquet"):
        load_rows("data.csv", 0, 0, {}, None)
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"), 0, 0, {}, None)


def _rows(n: int) -> list[Row]:
    return [Row(messages=[{"role": "user", "content": str(i)}], ground_truth=i, data_source="t") for i in range(n)]


def _ids(batch: list[Row]) -> list[int]:
    return [r.ground_truth for r in batch]


def test_iterator_epochs_and_determinism() -> None:
    rows = _rows(10)
    it = DataIterator(rows, batch_size=4, seed=3, shuffle=True)
    batches = [_ids(next(it)) for _ in range(5)]  # 20 rows = exactly 2 epochs
    assert all(len(b) == 4 for b in batches)
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))  # each row once per epoch
    assert flat[:10] != flat[10:]  # reshuffled
    assert flat[:10] != list(range(10))
    other = DataIterator(rows, batch_size=4, seed=3, shuffle=True)
    assert [_ids(next(other)) for _ in range(5)] == batches  # same seed, same order
    assert [_ids(next(DataIterator(rows, 4, seed=4)))] != [batches[0]]
    plain = DataIterator(rows, batch_size=4, seed=3, shuffle=False)
    assert [_ids(next(plain)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_iterator_state_round_trip() -> None:
    rows = _rows(7)
    it = DataIterator(rows, batch_size=3, seed=11)
    for _ in range(4):  # ends mid-epoch 1
        next(it)
    state = json.loads(json.dumps(it.state()))  # as stored in a checkpoint
    assert state["epoch"] == 1 and state["position"] == 5
    expected = [_ids(next(it)) for _ in range(6)]
    resumed = DataIterator(rows, batch_size=3, seed=11)
    resumed.load_state(state)
    assert [_ids(next(resumed)) for _ in range(6)] == expected
    with pytest.raises(ValueError, match="data set changed"):
        DataIterator(_rows(8), batch_size=3, seed=11).load_state(state)


def test_iterator_small_data_and_bad_args() -> None:
    it = DataIterator(_rows(2), batch_size=5, seed=0)
    assert sorted(_ids(next(it))) == [0, 0, 0, 1, 1]  # a batch larger than the data spans epochs
    with pytest.raises(ValueError):
        DataIterator([], batch_size=2, seed=0)
    with pytest.raises(ValueError):
        DataIterator(_rows(2), batch_size=0, seed=0)
