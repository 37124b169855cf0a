"""The portable `hf` engine backend (transformers): token ids + logprobs, and weight updates."""

from __future__ import annotations

import asyncio

import torch

from rayrl.config import EngineConfig
from rayrl.engine import Engine, Sampling
from rayrl.weight_sync.object_store import pack


def test_hf_backend_generates_and_reloads(tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 33, 2, 90]
    engine = Engine(tiny_model, EngineConfig(backend="hf"))

    async def go():
        await engine.start()
        before = await engine.generate(prompt, Sampling(max_tokens=6, temperature=0.0))
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        await engine.receive_weights("object_store", pack(model.state_dict(), 1), 1)
        after = await engine.generate(prompt, Sampling(max_tokens=6, temperature=0.0))
        await engine.shutdown()
        return model, before, after

    model, before, after = asyncio.run(go())
    assert after.policy_version == 1 and len(after.token_ids) == len(after.logprobs) > 0
    # the recorded logprobs are the new weights' log-softmax of each sampled token
    ids = torch.tensor([prompt + after.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    ref = lp.gather(-1, torch.tensor(after.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(after.logprobs), atol=1e-4)
    assert before.logprobs != after.logprobs
