"""Partial rollouts (engine.partial_rollout): a weight update that arrives while a request runs stops it at a token
boundary, the weights change, and it continues from the tokens already sampled; each token records the policy version
that produced it, and its logprob is the one that version gives it. Without partial rollouts the update waits for the
request to end. With engine.keep_kv_on_sync the request pauses in place instead and continues over the KV cache the
old weights computed. Real vLLM (CPU build) and SmolLM2; no Ray."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3, 4, 5]
N = 160  # tokens a request samples


def _logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of `ids` after `prompt` under a transformers model."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


async def _run(path: str, partial: bool, new_state: dict, keep_kv: bool = False, then: int = 0):
    from rayrl.config import EngineConfig
    from rayrl.engine import Engine, Sampling
    from rayrl.weight_sync.object_store import pack

    eng = Engine(path, EngineConfig(max_model_len=512, partial_rollout=partial, keep_kv_on_sync=keep_kv))
    await eng.start()
    try:
        # the update lands about a third of the way into the request: timed by a first request of the same length
        # now, not by a fixed sleep (on a loaded 2-core machine 160 tokens took anywhere from under 6 s to much more)
        t0 = time.monotonic()
        await eng.generate(PROMPT, Sampling(max_tokens=N, ignore_eos=True), "warm")
        took = time.monotonic() - t0
        req = asyncio.ensure_future(eng.generate(PROMPT, Sampling(max_tokens=N, ignore_eos=True), "r"))
        while not eng._running and not req.done():  # (done first: the assertions below say so)
            await asyncio.sleep(0.01)
        await asyncio.sleep(took / 3)  # some tokens sampled with version 0
        await eng.receive_weights("object_store", pack(new_state, 1), 1)
        gen = await asyncio.wait_for(req, 600)
        # a new request after the update over a prefix of the first one, which version 0 computed and the prefix
        # cache holds (longer than the CPU build's 128-token block: shorter prefixes are not cached)
        after = None if not then else await eng.generate(PROMPT + gen.token_ids[:then],
                                                         Sampling(max_tokens=16, ignore_eos=True), "n")
        return gen, eng.preemptions, after
    finally:
        await eng.shutdown()


def _models():
    """SmolLM2 as the engine loads it (version 0) and perturbed by 5% (version 1), with its path."""
    from transformers import AutoModelForCausalLM

    from rayrl.models import resolve_model

    path = resolve_model("smollm2")
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    return path, old, new


def test_partial_rollout_continues_with_the_new_weights_and_tags_each_token():
    path, old, new = _models()
    gen, preemptions, _ = asyncio.run(_run(path, True, new.state_dict()))
    k = gen.versions.count(0)
    assert len(gen.token_ids) == N and gen.finish_reason == "length" and preemptions == 1
    assert 0 < k < N and gen.versions == [0] * k + [1] * (N - k), gen.versions  # stopped once, continued
    lp = torch.tensor(gen.logprobs)
    by_old, by_new = _logprobs(old, PROMPT, gen.token_ids), _logprobs(new, PROMPT, gen.token_ids)
    assert (lp[:k] - by_old[:k]).abs().max() < 0.05  # the first part: sampled by version 0
    assert (lp[k:] - by_new[k:]).abs().max() < 0.05  # the rest: by version 1, continuing the same sequence
    assert (lp[k:] - by_old[k:]).abs().max() > 0.2  # (the two versions do differ on those tokens)


def test_without_partial_rollout_the_update_waits_for_the_request():
    from transformers import AutoModelForCausalLM

    from rayrl.models import resolve_model

    path = resolve_model("smollm2")
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen, preemptions, _ = asyncio.run(_run(path, False, new.state_dict()))
    assert len(gen.token_ids) == N and preemptions == 0 and set(gen.versions) == {0}


def test_keep_kv_on_sync_continues_in_place_over_the_old_weights_kv():
    """The request is paused, not stopped: after the update the new weights sample over the KV the old weights
    computed for the prompt and the tokens before (the last token sampled before the pause is fed through the new
    weights, as the next step computes its KV). Its logprobs are those of exactly that mix, not the new weights'
    over the whole sequence, and each token is tagged with the version that sampled it. A new request after the
    update does not reuse the old KV that the prefix cache still holds: it is the new weights' alone."""
    path, old, new = _models()
    gen, preemptions, after = asyncio.run(_run(path, True, new.state_dict(), keep_kv=True, then=140))
    k = gen.versions.count(0)
    assert len(gen.token_ids) == N and gen.finish_reason == "length" and preemptions == 1
    assert 1 < k < N and gen.versions == [0] * k + [1] * (N - k), gen.versions
    lp, ids = torch.tensor(gen.logprobs), gen.token_ids
    assert (lp[:k] - _logprobs(old, PROMPT, ids)[:k]).abs().max() < 0.05  # sampled by version 0
    with torch.no_grad():  # old KV up to the token before the pause's last one, then the new weights
        past = old(torch.tensor([PROMPT + ids[: k - 1]]), use_cache=True).past_key_values
        logits = new(torch.tensor([ids[k - 1 : -1]]), past_key_values=past).logits[0].float()
    mixed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[k:])[:, None])[:, 0]
    gap = (lp[k:] - mixed).abs()
    assert gap.max() < 0.05, f"paused after {k} tokens; token {k + int(gap.argmax())} is {gap.max():.3f} off"
    assert (lp[k:] - _logprobs(new, PROMPT, ids)[k:]).abs().max() > 0.05  # (recomputed KV would give these)
    assert set(after.versions) == {1}
    fresh = (torch.tensor(after.logprobs) - _logprobs(new, PROMPT + ids[:140], after.token_ids)).abs()
    assert fresh.max() < 0.05, f"the request after the update is {fresh.max():.3f} off the new weights' logprobs"
