"""Task sources: reasoning-gym generators and parquet/jsonl files in verl's row format.

verl's row format (one row per prompt):
    prompt        list of chat messages [{"role": ..., "content": ...}, ...]
    reward_model  {"ground_truth": ..., "style": "rule"}
    data_source   str (selects the scorer under reward.fn=auto)
    extra_info    dict, optional (passed to the scorer)
    agent_name    ignored (the agent comes from rollout.agent)

`DataIterator` deals rows out in batches, epoch after epoch, and its state (epoch, position) goes
into checkpoints so that a resumed run continues at exactly the same row.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data source or row that cannot be used; the message names the file and the row (one line)."""


@dataclass
class Row:
    """One prompt and what is needed to score it."""

    messages: list[dict[str, Any]]
    ground_truth: Any
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)


def load_rows(source: str, size: int, seed: int, gym_kwargs: dict[str, Any] | None = None,
              system_prompt: str | None = None) -> list[Row]:
    """Rows from "reasoning_gym:<task>" (`size` generated with `seed`) or a .parquet/.jsonl/.json file.

    Raises ValueError naming the source (and, for files, the row) when something is wrong.
    """
    if source.startswith("reasoning_gym:"):
        return _gym_rows(source.split(":", 1)[1], size, seed, gym_kwargs or {}, system_prompt)
    if source.endswith((".parquet", ".jsonl", ".json")):
        if not os.path.exists(source):
            raise DataError(f"data file {source!r} does not exist")
        return [_verl_row(raw, source, n, system_prompt) for n, raw in _read_records(source)]
    raise DataError(f"data source {source!r} must be reasoning_gym:<task> or a .parquet/.jsonl/.json file")


# --- reasoning-gym -----------------------------------------------------------------------------

def _gym_rows(task: str, size: int, seed: int, gym_kwargs: dict[str, Any], system_prompt: str | None) -> list[Row]:
    import reasoning_gym  # heavy, only for gym sources

    if task not in reasoning_gym.factory.DATASETS:
        raise DataError(f"reasoning_gym:{task}: unknown reasoning-gym task {task!r}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **gym_kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise DataError(f"reasoning_gym:{task}: cannot create the dataset with data.gym_kwargs={gym_kwargs} "
                         f"({type(e).__name__}: {e})") from None
    rows = []
    for i in range(size):
        # A deep copy: the entry travels to the scorer (pickled) and must not share state with the generator.
        entry = copy.deepcopy(dict(dataset[i]))
        rows.append(Row(messages=_with_system([{"role": "user", "content": entry["question"]}], system_prompt),
                        ground_truth=entry["answer"], data_source=f"reasoning_gym/{task}",
                        extra_info={"entry": entry, "index": i}))
    return rows


# --- verl-format files -------------------------------------------------------------------------

def _read_records(path: str) -> Iterator[tuple[int, Any]]:
    """(row number, record) pairs; row numbers are 1-based (the line number for .jsonl)."""
    name = path  # errors name the file as the config gave it
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()  # plain lists and dicts, no numpy arrays
        except Exception as e:  # noqa: BLE001 - pyarrow has many error types; all mean "not readable"
            raise DataError(f"{name}: cannot read parquet ({type(e).__name__}: {e})") from None
        yield from enumerate(records, start=1)
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{name}: not valid JSON ({e})") from None
        yield from enumerate(records, start=1)
        return
    # .jsonl, or a .json file holding one object per line (pandas' to_json(lines=True))
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{name} row {n}: not valid JSON ({e.msg} at column {e.colno})") from None


def _plain(value: Any) -> Any:
    """numpy arrays/scalars (from pandas-written files) -> lists/Python scalars, recursively."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _verl_row(raw: Any, name: str, n: int, system_prompt: str | None) -> Row:
    where = f"{name} row {n}"
    if not isinstance(raw, dict):
        raise DataError(f"{where}: must be an object with prompt, reward_model and data_source, "
                         f"got {type(raw).__name__}")
    raw = _plain(raw)
    prompt = raw.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: prompt must be a non-empty list of {{role, content}} messages")
    messages = []
    for k, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), (str, list))):
            raise DataError(f"{where}: prompt must be a non-empty list of {{role, content}} messages "
                             f"(message {k} is {_short(m)})")
        if m["role"] not in _ROLES:
            raise DataError(f"{where}: prompt message {k} has role {m['role']!r} "
                             f"(expected one of {', '.join(_ROLES)})")
        # Parquet structs carry every key of every row; drop the ones this message does not set.
        messages.append({key: v for key, v in m.items() if v is not None})
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where}: reward_model must be a mapping with a ground_truth, got {_short(reward_model)}")
    data_source = raw.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DataError(f"{where}: data_source must be a non-empty string, got {_short(data_source)}")
    extra_info = raw.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: extra_info must be a mapping, got {_short(extra_info)}")
    return Row(messages=_with_system(messages, system_prompt), ground_truth=reward_model["ground_truth"],
               data_source=data_source, extra_info=extra_info)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


# --- batching ----------------------------------------------------------------------------------

class DataIterator:
    """Endless batches of rows; each epoch is a fresh permutation seeded by (seed, epoch).

    A batch that reaches the end of an epoch is completed from the next one, so every batch has
    `batch_size` rows and every row is used once per epoch. State is (epoch, position in the
    epoch's order): `load_state(state())` on a new iterator over the same rows continues identically.
    """

    def __init__(self, rows: list[Row], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("DataIterator needs at least one row")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        # numpy's SeedSequence mixes (seed, epoch) into independent streams, the same on every machine.
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)).tolist()

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> list[Row]:
        return self.next_batch()

    def next_batch(self) -> list[Row]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self.rows):
                self.epoch += 1
                self.position = 0
                self._order = self._order_for(self.epoch)
            take = min(self.batch_size - len(batch), len(self.rows) - self.position)
            batch.extend(self.rows[i] for i in self._order[self.position:self.position + take])
            self.position += take
        return batch

    def state(self) -> dict[str, int]:
        """Where the next batch starts; `num_rows` lets load_state catch a changed data set."""
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows)}

    def load_state(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if "num_rows" in state and int(state["num_rows"]) != len(self.rows):
            raise ValueError(f"data iterator state is for {state['num_rows']} rows, but the data has {len(self.rows)}: "
                             "the data set changed since the checkpoint")
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise ValueError(f"data iterator state {state} is out of range for {len(self.rows)} rows")
        self.epoch, self.position = epoch, position
        self._order = self._order_for(epoch)
