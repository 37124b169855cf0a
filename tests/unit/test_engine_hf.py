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


def test_sleep_does_not_wait_for_requests_that_arrive_asleep(tiny_model):
    """A request that arrives while the engine goes to sleep waits for the wake; the sleep does not wait for it (it
    would until engine.sync_timeout), and the request then runs on the woken engine."""
    engine = Engine(tiny_model, EngineConfig(backend="hf", sync_timeout=30))

    async def go():
        await engine.start()
        running = asyncio.create_task(engine.generate([5, 17, 33], Sampling(max_tokens=4, temperature=0.0)))
        while not engine._running:  # on the backend now
            await asyncio.sleep(0)
        sleeping = asyncio.create_task(engine.sleep(1))
        await asyncio.sleep(0.01)
        late = asyncio.create_task(engine.generate([5, 17, 33], Sampling(max_tokens=4, temperature=0.0)))
        slept = await asyncio.wait_for(sleeping, 10)  # the running request finished; the late one waits
        first = await asyncio.wait_for(running, 30)
        assert not late.done() and engine.inflight == 1 and engine.asleep_tags == {"weights", "kv_cache"}
        await engine.wake_up()
        second = await asyncio.wait_for(late, 30)
        await engine.shutdown()
        return slept, first, second

    slept, first, second = asyncio.run(go())
    assert slept < 10 and len(first.token_ids) == len(second.token_ids) == 4
    assert first.token_ids == second.token_ids  # greedy, same weights after the wake
