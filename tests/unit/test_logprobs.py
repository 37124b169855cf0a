"""At any rollout.temperature the learner's log-probs are of the distribution the engines sampled from (logits /
temperature, verl's logits.div_(temperature)), and so are the engines' behaviour log-probs (vLLM's
processed_logprobs; the `hf` backend's scores here, vLLM in tests/integration/test_temperature.py): what the rollout
correction and the rollout_corr/ mismatch metrics compare."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayrl.config import EngineConfig, load_config
from rayrl.engine import Engine, Sampling
from rayrl.types import TrainBatch

PROMPTS = [[5, 17, 33, 2, 90], [7, 8, 9]]


def _generate(model: str, temperature: float) -> list:
    engine = Engine(model, EngineConfig(backend="hf"))

    async def go():
        await engine.start()
        try:
            return [await engine.generate(p, Sampling(max_tokens=8, temperature=temperature)) for p in PROMPTS]
        finally:
            await engine.shutdown()

    return asyncio.run(go())


def _raw_logprobs(model: str, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Temperature-1 log-probs of `ids` after `prompt` (what vLLM reports by default, logprobs_mode raw_logprobs)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        logits = m(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_learner_logprobs_are_the_engines_at_the_sampling_temperature(tiny_model, temperature):
    from rayrl.learner import Learner

    gens = _generate(tiny_model, temperature)
    responses = [g.token_ids for g in gens]
    assert all(len(r) == len(g.logprobs) > 0 for r, g in zip(responses, gens, strict=True))
    ln = Learner(tiny_model, load_config(None, [f"rollout.temperature={temperature}"], check_files=False))
    ln.setup()
    try:
        batch = TrainBatch(prompt_ids=PROMPTS, response_ids=responses, loss_mask=[[1] * len(r) for r in responses],
                           advantages=[[0.0] * len(r) for r in responses],
                           global_tokens=sum(map(len, responses)), global_seqs=len(responses))
        learner = ln.compute_logprobs(batch)
    finally:
        ln.shutdown()
    for p, g, lp in zip(PROMPTS, gens, learner, strict=True):
        assert torch.allclose(torch.tensor(lp), torch.tensor(g.logprobs), atol=1e-4), (lp, g.logprobs)
        gap = (_raw_logprobs(tiny_model, p, g.token_ids) - torch.tensor(g.logprobs)).abs().max()
        # temperature-1 log-probs would be another distribution's (the gap the rollout correction would misread)
        assert gap < 1e-4 if temperature == 1.0 else gap > 0.01, gap
