"""Scorers (each spec on a right and a wrong answer) and answer extraction."""

from __future__ import annotations

import pickle

import pytest

from rayrl.config import ConfigError
from rayrl.rewards import as_score, extract_answer, resolve_scorer


@pytest.fixture(scope="module")
def arith_entry() -> dict:
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3, min_terms=2, max_terms=2,
                                      min_digits=1, max_digits=2)
    return dict(ds[0])


@pytest.mark.parametrize("spec", ["reasoning_gym", "auto"])
def test_reasoning_gym(spec: str, arith_entry: dict) -> None:
    score = resolve_scorer(spec)
    right, wrong = arith_entry["answer"], str(int(arith_entry["answer"]) + 1)
    info = {"entry": arith_entry, "index": 0}
    assert score("reasoning_gym/basic_arithmetic", f"Thinking... <answer>{right}</answer>", right, info) == 1.0
    assert score("reasoning_gym/basic_arithmetic", f"<answer>{wrong}</answer>", right, info) == 0.0
    assert score("reasoning_gym/basic_arithmetic", right, right, info) == 1.0  # an already-extracted answer


def test_reasoning_gym_without_entry_uses_ground_truth() -> None:
    score = resolve_scorer("reasoning_gym")
    assert score("reasoning_gym/basic_arithmetic", "<answer>12</answer>", "12", {}) == 1.0
    assert score("reasoning_gym/basic_arithmetic", "<answer>13</answer>", "12", {}) == 0.0


def test_math_dapo() -> None:
    score = resolve_scorer("math_dapo")
    assert score("math_dapo", "Let me think.\nAnswer: 42", "42", {}) == 1.0
    assert score("math_dapo", "so the result is \\boxed{42}", "42", {}) == 1.0
    assert score("math_dapo", "Answer: 41", "42", {}) == -1.0  # DAPO's penalty, not 0
    assert score("math_dapo", "Answer: 42", 42, {}) == 1.0  # numeric ground truth from a jsonl file


@pytest.mark.parametrize("num_turns, wrong", [(2, -1.0), (4, -0.9), (6, -0.8), (10, -0.6), (30, -0.6)])
def test_retool_shapes_wrong_answers_by_turns(num_turns: int, wrong: float) -> None:
    """verl recipe/retool's compute_score: a wrong answer's -1 rises by 0.1 per tool round (two turns), to -0.6."""
    score = resolve_scorer("retool")
    assert score("math_dapo", "so the answer is \\boxed{42}", "42", {"num_turns": num_turns}) == 1.0
    assert score("math_dapo", "so the answer is \\boxed{41}", "42", {"num_turns": num_turns}) == pytest.approx(wrong)


def test_retool_verifies_the_box_strictly() -> None:
    score = resolve_scorer("retool")
    info = {"num_turns": 2}
    assert score("aime_2024", "Answer: 42", "42", info) == -1.0  # math_dapo alone would accept it (1.0)
    assert resolve_scorer("math_dapo")("aime_2024", "Answer: 42", "42", info) == 1.0
    assert score("aime_2024", "\\boxed{42}" + " and then I kept writing." * 5, "42", info) == -1.0  # not in the tail
    assert score("aime_2024", "\\boxed{42.0}", "42", info) == -1.0  # compared as written: no normalisation
    assert score("aime_2024", "\\boxed{41} no wait, \\boxed{42}", "42", info) == 1.0  # the last box counts


def test_retool_needs_the_turn_count() -> None:
    with pytest.raises(ValueError, match="extra_info\\['num_turns'\\]"):
        resolve_scorer("retool")("math_dapo", "\\boxed{1}", "2", {})


def test_turn_count_reaches_the_scorer_through_the_reward_request() -> None:
    """The rollout worker's request carries the episode's turns in extra_info["num_turns"] (verl's key), next to the
    task's own extra_info; what the RewardActor's pool runs on it gets the shaped score."""
    from rayrl.rewards import score_with_spec
    from rayrl.rollout import reward_request
    from rayrl.types import Task

    task = Task(task_id="g/0", group_id="g", step=0, ground_truth="42", data_source="math_dapo",
                messages=[{"role": "user", "content": "?"}], extra_info={"index": 7})
    req = reward_request(task, "I computed \\boxed{41}.", 6)
    assert req.extra_info == {"index": 7, "num_turns": 6} and task.extra_info == {"index": 7}
    args = (req.data_source, req.solution_str, req.ground_truth, req.extra_info)  # as Reward._submit passes them
    assert score_with_spec("retool", *args) == pytest.approx(-0.8)


def test_math_verify() -> None:
    score = resolve_scorer("math_verify")
    assert score("math", "so $x = \\boxed{\\frac{1}{2}}$", "0.5", {}) == 1.0
    assert score("math", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", {}) == 1.0
    assert score("math", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", {}) == 0.0


def test_auto_uses_verl_by_data_source() -> None:
    score = resolve_scorer("auto")
    assert score("math_dapo", "Answer: 7", "7", {}) == 1.0
    assert score("math_dapo", "Answer: 8", "7", {}) == -1.0
    assert score("openai/gsm8k", "so #### 72", "72", {}) == 1.0
    with pytest.raises(NotImplementedError):  # becomes a recorded error in the RewardActor
        score("no/such_source", "1", "1", {})


def test_custom() -> None:
    score = resolve_scorer("tests.helpers:exact")
    assert score("x", " 5 ", "5", {}) == 1.0
    assert score("x", "6", "5", {}) == 0.0
    assert resolve_scorer("tests.helpers:dict_score")("x", "", "", {}) == 0.5
    with pytest.raises(TypeError, match="expected a number"):
        resolve_scorer("tests.helpers:not_a_number")("x", "", "", {})
    assert pickle.loads(pickle.dumps(score))("x", "5", "5", {}) == 1.0  # travels to pool workers


def test_bad_specs() -> None:
    with pytest.raises(ConfigError, match="must be one of auto, reasoning_gym, math_dapo, math_verify, retool"):
        resolve_scorer("mathdapo")
    with pytest.raises(ConfigError, match="cannot import module"):
        resolve_scorer("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="has no function"):
        resolve_scorer("tests.helpers:nope")


def test_as_score() -> None:
    assert as_score(True) == 1.0
    assert as_score({"score": -1, "acc": False}) == -1.0
    for bad in (None, "x", float("nan"), {"acc": 1}):
        with pytest.raises((TypeError, ValueError)):
            as_score(bad)


@pytest.mark.parametrize("text, want", [
    ("reasoning <answer>7</answer> more <answer> 8 </answer>", "8"),
    ("<answer>x + 1</answer> and later \\boxed{3}", "x + 1"),  # the tag wins over a box
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{{2}}", "{2}"),
    ("5 - 3 = 2.", "2"),
    ("5-3", "3"),  # a binary minus is not a sign
    ("the answer is -4.5", "-4.5"),
    ("x = -7", "-7"),
    ("about 1,250 apples", "1250"),
    ("cut off \\boxed{1 + {2", "2"),  # an unclosed box falls through to the last number
    ("no digits here", None),
    ("", None),
])
def test_extract_answer(text: str, want: str | None) -> None:
    assert extract_answer(text) == want
