"""rollout.temperature != 1: the engines' behaviour log-probs (vLLM, logprobs_mode processed_logprobs) and the
learner's (logits / rollout.temperature) are of the same distribution, so the engine-vs-learner gap that the rollout
correction and the rollout_corr/ metrics see at 0.6 is as small as at 1.0. Real vLLM (CPU build) and SmolLM2; no
Ray."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The derivative of x squared is"]


async def _sample(path: str, prompts: list[list[int]], temperatures: list[float]) -> dict[float, list]:
    from rayrl.config import EngineConfig
    from rayrl.engine import Engine, Sampling

    eng = Engine(path, EngineConfig(max_model_len=512))
    await eng.start()
    try:
        return {t: list(await asyncio.gather(*(eng.generate(p, Sampling(max_tokens=48, temperature=t))
                                               for p in prompts)))
                for t in temperatures}
    finally:
        await eng.shutdown()


def _mismatch(path: str, prompts: list[list[int]], gens: list, temperature: float) -> dict[str, float]:
    """The rollout_corr/ metrics of a learner at rollout.temperature=`temperature` against the engine's log-probs."""
    from rayrl.batching import rollout_correction
    from rayrl.config import load_config
    from rayrl.learner import Learner
    from rayrl.types import TrainBatch

    cfg = load_config(None, [f"rollout.temperature={temperature}"], check_files=False)
    responses = [g.token_ids for g in gens]
    batch = TrainBatch(prompt_ids=prompts, response_ids=responses, loss_mask=[[1] * len(r) for r in responses],
                       advantages=[[0.0] * len(r) for r in responses], global_tokens=sum(map(len, responses)),
                       global_seqs=len(responses), rollout_logprobs=[g.logprobs for g in gens])
    ln = Learner(path, cfg)
    ln.setup()
    try:
        learner = ln.compute_logprobs(batch)
    finally:
        ln.shutdown()
    return rollout_correction([[batch]], [[learner]], cfg.algo.rollout_correction)


def test_engine_and_learner_logprobs_agree_at_temperature_0_6_as_at_1():
    from transformers import AutoTokenizer

    from rayrl.models import resolve_model

    path = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    gens = asyncio.run(_sample(path, prompts, [1.0, 0.6]))
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for gs in gens.values() for g in gs)
    at_1, at_06 = _mismatch(path, prompts, gens[1.0], 1.0), _mismatch(path, prompts, gens[0.6], 0.6)
    # what a temperature-1 learner (or temperature-1 engine log-probs) would make of the same 0.6 samples
    wrong = _mismatch(path, prompts, gens[0.6], 1.0)
    print({"1.0": at_1, "0.6": at_06, "0.6 vs a temperature-1 learner": wrong})  # noqa: T201 - the figures, with -s
    gap_1, gap_06 = at_1["rollout_corr/log_ratio_max"], at_06["rollout_corr/log_ratio_max"]
    assert gap_06 < max(3 * gap_1, 0.05), (gap_06, gap_1)
    assert abs(at_06["rollout_corr/log_ratio_mean"]) < max(3 * abs(at_1["rollout_corr/log_ratio_mean"]), 0.01)
    assert wrong["rollout_corr/log_ratio_max"] > 10 * gap_06 and wrong["rollout_corr/log_ratio_max"] > 0.5
