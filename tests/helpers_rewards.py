"""Scorers used by the reward tests; top-level so the reward pool's subprocesses can import them."""

from __future__ import annotations

import os
import time
from typing import Any


def exact(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the answer equals the ground truth (after strip), else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def slow_or_exact(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """Sleeps extra_info["sleep"] seconds first (to run past the pool's timeout), then scores like `exact`."""
    time.sleep(float(extra_info.get("sleep", 0)))
    return exact(data_source, solution_str, ground_truth, extra_info)


def raising(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    raise ValueError(f"cannot score {solution_str!r}")


def dict_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> dict:
    """verl-style dict result."""
    return {"score": 0.5, "acc": True}


def not_a_number(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> Any:
    return "high"


def crash(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """Kills its own process, as a segfaulting native library would."""
    os._exit(3)


def digit_count(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """A reward a random tiny model's samples differ on (digits in the reply, mod 3): GRPO groups get signal."""
    return float(sum(ch.isdigit() for ch in solution_str) % 3)
