"""Reward scorers: `score(data_source, solution_str, ground_truth, extra_info) -> float`.

`resolve_scorer(spec)` turns `reward.fn` into such a callable:

- "reasoning_gym": reasoning-gym's own `score_answer` for the entry in extra_info["entry"];
- "math_dapo": verl's DAPO scorer ("Answer: x" or \\boxed{x}; +1 correct, -1 wrong);
- "math_verify": Hugging Face math-verify (symbolic equivalence; 1 correct, 0 wrong);
- "retool": verl's recipe/retool `compute_score`: math_dapo with strict \\boxed{} verification, a wrong answer's -1
  raised by the turns it took (extra_info["num_turns"]), at most to -0.6;
- "auto": reasoning_gym for "reasoning_gym/..." data sources, else verl's default_compute_score;
- "module:function": a custom scorer with the same signature.

Every scorer returned is a top-level function (or a partial of one), so it pickles by reference
and runs in the RewardActor's process pool. Heavy libraries are imported on first use; `warm(spec)`
imports them ahead of time so the import is not charged to the first score's timeout.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable
from typing import Any

Scorer = Callable[[str, str, Any, dict], float]


# --- answer extraction -------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A minus sign counts only when it cannot be a binary minus ("5-3" ends in 3, not -3);
# thousands separators ("1,000") are part of the number and dropped from the answer.
_NUMBER = re.compile(r"(?:(?<![\w.)\]])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: the model was cut off inside the box


def tagged_answer(text: str) -> str | None:
    """The last <answer>...</answer> content, else the last \\boxed{...} content, else None."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    return last_boxed(text)


def extract_answer(text: str) -> str | None:
    """The model's final answer: last <answer> tag, else last \\boxed{}, else last number, else None."""
    if not isinstance(text, str):
        return None
    found = tagged_answer(text)
    if found is not None:
        return found
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


# --- score normalisation -----------------------------------------------------------------------

def as_score(value: Any) -> float:
    """A scorer's return value as a finite float; dicts (verl style) give their "score".

    Anything else raises, so a broken scorer is recorded as an error, never read as 0.0.
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"scorer returned a dict without 'score' (keys: {sorted(value)})")
        value = value["score"]
    if isinstance(value, bool):
        return float(value)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"scorer returned {type(value).__name__} {value!r}, expected a number") from None
    if not math.isfinite(out):
        raise ValueError(f"scorer returned {out}")
    return out


def _text(ground_truth: Any) -> str:
    return ground_truth if isinstance(ground_truth, str) else str(ground_truth)


# --- built-in scorers --------------------------------------------------------------------------

def score_reasoning_gym(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    """reasoning-gym's own `score_answer`, on `extract_answer(solution_str)` (the <answer> tag, else the last
    \\boxed{}, else the last number; the whole text when none is found)."""
    import reasoning_gym  # heavy

    entry = (extra_info or {}).get("entry")
    if entry is None:
        # A file row tagged reasoning_gym/<task> without the generator's entry: score against the ground truth.
        entry = {"question": "", "answer": _text(ground_truth), "metadata": {}}
    task = (entry.get("metadata") or {}).get("source_dataset") or data_source.split("/", 1)[-1]
    answer = extract_answer(solution_str)
    if answer is None:
        answer = solution_str.strip()
    return as_score(reasoning_gym.get_score_answer_fn(task)(answer, entry))


def score_math_dapo(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    """verl's math_dapo: +1.0 when "Answer: x" (or the last \\boxed{x}) matches, else -1.0."""
    from verl.utils.reward_score import math_dapo  # imports torch via verl/__init__

    return as_score(math_dapo.compute_score(solution_str, _text(ground_truth)))


def score_retool(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    """verl v0.6.1 recipe/retool's compute_score: +1.0 when the last \\boxed{} of the answer's last 100 characters
    equals the ground truth as written (math_dapo's strict_box_verify: no normalisation, no "Answer:" line), else
    -1.0 + 0.05 per turn beyond two, capped at -0.6: a wrong answer reached by calling the tool scores above one
    that did not. extra_info["num_turns"] is verl's count (tool/user turns + model replies + 1: 2 for one reply,
    4 for a call and an answer). verl scores the decoded whole response, rayrl the agent's answer (its last reply):
    the same text wherever that reply holds the box in its last 100 characters."""
    from verl.utils.reward_score import math_dapo  # imports torch via verl/__init__

    num_turns = (extra_info or {}).get("num_turns")
    if isinstance(num_turns, bool) or not isinstance(num_turns, int):
        raise ValueError(f"reward.fn=retool needs the episode's turn count in extra_info['num_turns'] (an int), "
                         f"got {num_turns!r}")
    score = as_score(math_dapo.compute_score(solution_str, _text(ground_truth), strict_box_verify=True))
    if score < 0:
        score = min(-0.6, score + (num_turns - 2) / 2 * 0.1)
    return score


def score_math_verify(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    """math-verify equivalence: 1.0 or 0.0.

    Called directly rather than through verl's wrapper, which runs its own process pool (pool
    workers are daemonic and may not have children) and turns every error into a silent 0.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify's own timeouts use signal.alarm, which only works in a main thread; elsewhere
    # the caller (the RewardActor's pool) enforces the time limit by killing the process.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gt = _text(ground_truth)
    gold = parse(gt if "\\boxed" in gt else "\\boxed{" + gt + "}", (LatexExtractionConfig(),), parsing_timeout=limit)
    pred = parse(solution_str, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math_verify could not parse the ground truth {gt!r}")
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


def score_auto(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    """reasoning_gym for "reasoning_gym/..." sources, else verl's default_compute_score by data_source."""
    if data_source.startswith("reasoning_gym"):
        return score_reasoning_gym(data_source, solution_str, ground_truth, extra_info)
    from verl.utils.reward_score import default_compute_score  # imports torch

    # verl's math scorers call str methods on the ground truth; numbers from a jsonl file would crash
    # them. Other types (search-R1's {"target": [...]}) are passed through as verl expects them.
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    return as_score(default_compute_score(data_source, solution_str, ground_truth, extra_info))


def score_custom(spec: str, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float:
    """Call the user's "module:function" scorer (bound with functools.partial by resolve_scorer)."""
    return as_score(_custom(spec)(data_source, solution_str, ground_truth, extra_info))


@functools.cache
def _custom(spec: str) -> Callable[..., Any]:
    from rayrl.config import check_callable  # keeps pool workers from importing yaml early

    return check_callable(spec, "reward.fn")


# `reward.fn` names -> scorers; rayrl.config validates reward.fn against this table.
BUILTIN_SCORERS: dict[str, Scorer] = {
    "auto": score_auto,
    "reasoning_gym": score_reasoning_gym,
    "math_dapo": score_math_dapo,
    "math_verify": score_math_verify,
    "retool": score_retool,
}


def resolve_scorer(spec: str) -> Scorer:
    """`reward.fn` -> score(data_source, solution_str, ground_truth, extra_info) -> float.

    A custom spec is imported now, so a typo fails at startup with a ConfigError naming reward.fn.
    """
    if spec in BUILTIN_SCORERS:
        return BUILTIN_SCORERS[spec]
    if ":" not in spec:
        from rayrl.config import ConfigError

        raise ConfigError(f"reward.fn={spec!r} must be one of {', '.join(BUILTIN_SCORERS)} or 'module:function'")
    _custom(spec)
    return functools.partial(score_custom, spec)


# --- pool-worker entry points ------------------------------------------------------------------

def score_with_spec(spec: str, data_source: str, solution_str: str, ground_truth: Any,
                    extra_info: dict | None) -> float:
    """Resolve `spec` (cached) and score: what the RewardActor runs in its worker processes."""
    return as_score(_resolved(spec)(data_source, solution_str, ground_truth, extra_info))


@functools.cache
def _resolved(spec: str) -> Scorer:
    return resolve_scorer(spec)


def warm(spec: str) -> None:
    """Import what `spec` needs, so a pool worker's first score does not pay for the import.

    Never raises: a scorer that cannot load reports its error on the first score instead.
    """
    try:
        if spec in ("reasoning_gym", "auto"):
            import reasoning_gym  # noqa: F401
        if spec in ("math_dapo", "retool", "auto"):
            import verl.utils.reward_score
            import verl.utils.reward_score.math_dapo  # noqa: F401
        if spec == "math_verify":
            import math_verify  # noqa: F401
        _resolved(spec)
    except Exception:  # noqa: BLE001 - reported on the first score
        pass
