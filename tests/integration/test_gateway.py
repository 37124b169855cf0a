"""The Gateway over real HTTP on a local Ray, in front of a real CPU vLLM engine with the tiny random Qwen2."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import ray

from rayrl.actors.engine import EngineActor
from rayrl.actors.gateway import GatewayActor
from rayrl.actors.reward import RewardActor
from rayrl.agent import session_client
from rayrl.config import load_config
from rayrl.engine import Sampling
from rayrl.rollout import Rollout
from rayrl.types import Task
from tests.helpers import ROOT, free_port, tiny_overrides

pytestmark = pytest.mark.integration

MAX_LEN = 2048  # room for a generation long enough to outlast the Gateway's 0.5 s disconnect poll


@pytest.fixture(scope="module")
def gw(tiny_model, ray_cluster):
    """(config, engine handle, gateway handle, gateway base URL); one engine for the whole module."""
    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "engine.max_model_len": MAX_LEN, "rollout.max_response_length": 256, "data.max_prompt_length": 200,
        "rollout.agent": "tests.helpers:gateway_tool_agent"}))
    engine = EngineActor.options(num_cpus=1, max_concurrency=1000).remote(tiny_model, cfg.engine, "float32", 0,
                                                                          "engine/0")
    ray.get(engine.start.remote(), timeout=300)
    gateway = GatewayActor.options(num_cpus=0, max_concurrency=1000).remote(cfg, tiny_model, [engine])
    url = ray.get(gateway.start.remote(), timeout=120)
    yield cfg, engine, gateway, url
    ray.get(gateway.shutdown.remote(), timeout=30)
    ray.get(engine.shutdown.remote(), timeout=60)
    ray.kill(gateway)
    ray.kill(engine)


def _open(gateway, task_id="t", **kw):
    return ray.get(gateway.open_session.remote(task_id, **kw), timeout=30)


def _close(gateway, sid):
    return ray.get(gateway.close_session.remote(sid), timeout=30)


def _task(text="What is 12 + 35?", tid="s0/p0/0") -> Task:
    return Task(task_id=tid, group_id=tid.rsplit("/", 1)[0], step=0, data_source="test", ground_truth="47",
                messages=[{"role": "system", "content": "Solve the arithmetic problem."},
                          {"role": "user", "content": text}])


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) runs of the loss mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_models_health_and_unbound(gw):
    _cfg, _, gateway, url = gw
    r = httpx.get(f"{url}/v1/models", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    before = ray.get(gateway.stats.remote())
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="anything", max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=5, n=2)
    assert len(reply.choices) == 2 and reply.usage.completion_tokens <= 10
    after = ray.get(gateway.stats.remote())
    assert after["unbound_requests"] == before["unbound_requests"] + 1
    assert after["recorded_turns"] == before["recorded_turns"]  # served, not recorded


def test_three_turns_with_tool_calls_are_token_exact(gw, tiny_model):
    """An agent (openai SDK via ctx.llm) makes 3 turns with tool calls and tool results in between. The Trajectory
    the learner gets is exactly: the first prompt as the chat template renders it; then per turn the engine's own
    token ids (mask 1, the engine's logprobs as the HTTP responses reported them) and, between turns, the template's
    tokens for the tool message (mask 0). Re-running the engine greedily on each turn's prefix reproduces each turn."""
    from transformers import AutoTokenizer

    cfg, engine, gateway, _ = gw
    tok = AutoTokenizer.from_pretrained(tiny_model)
    worker = Rollout("test/0", cfg, None, gateway, None)
    task = _task()
    traj = asyncio.run(worker.run_task(task))
    assert traj.error is None, traj.error
    seen = traj.metadata["seen"]
    assert traj.num_turns == 3 and len(seen) == 3

    from tests.helpers import TOOLS

    first = tok.apply_chat_template(task.messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert traj.prompt_ids == tok.encode(first, add_special_tokens=False)
    segs = _segments(traj.loss_mask)
    assert [v for _, _, v in segs] == [1, 0, 1, 0, 1]
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    model_segs = [(a, b) for a, b, v in segs if v == 1]
    for (a, b), s in zip(model_segs, seen, strict=True):
        assert b - a == s["completion_tokens"]
        assert traj.logprobs[a:b] == s["logprobs"]  # bit-exact: the engine's floats, through JSON and back
        assert tok.decode(traj.response_ids[a:b], skip_special_tokens=True) == s["content"]
    for k, (a, b, _) in enumerate(s for s in segs if s[2] == 0):
        assert all(lp == 0.0 for lp in traj.logprobs[a:b])
        env = tok.decode(traj.response_ids[a:b], skip_special_tokens=False)
        ended = traj.response_ids[a - 1] == tok.eos_token_id
        tool = f"\n<|im_start|>tool\n{k + 1}<|im_end|>\n<|im_start|>assistant\n"
        assert env == ("" if ended else tok.eos_token) + tool
    # the engine itself, asked greedily for each turn on the exact same prefix, gives the same tokens
    for a, b in model_segs:
        greedy = Sampling(max_tokens=b - a, temperature=0.0)
        g = ray.get(engine.generate.remote(traj.prompt_ids + traj.response_ids[:a], greedy), timeout=60)
        assert g.token_ids == traj.response_ids[a:b]
        assert max(abs(x - y) for x, y in zip(g.logprobs, traj.logprobs[a:b], strict=True)) < 1e-4


def test_binding_by_key_and_by_prefix(gw):
    _cfg, _, gateway, url = gw
    # by key: the fixed base URL, the session's key
    sid, key, _ = _open(gateway, "by-key")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "one two"}], max_tokens=3)
    assert _close(gateway, sid).num_turns == 1

    # by prefix: fixed URL and key (an external service); the task text picks the session, the history follows it
    sid1, _, _ = _open(gateway, "p1", match="What is 7 + 8?")
    sid2, _, _ = _open(gateway, "p2", match="What is 9 + 1?")
    fixed = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-fixed", max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Task: What is 9 + 1?"}]
    r1 = fixed.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    fixed.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    rec1, rec2 = _close(gateway, sid1), _close(gateway, sid2)
    assert rec1.num_turns == 0 and rec2.num_turns == 2
    assert [v for _, _, v in _segments(rec2.loss_mask)] == [1, 0, 1]


def test_stream_and_completions(gw, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    _cfg, _, gateway, _url = gw
    sid, key, base = _open(gateway, "stream")
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    chunks = list(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    rec = _close(gateway, sid)
    assert rec.num_turns == 1 and finish and usage[0].completion_tokens == len(rec.response_ids)
    assert text == tok.decode(rec.response_ids, skip_special_tokens=True)  # the chunks join to the recorded reply

    sid, key, base = _open(gateway, "cmpl")
    c = openai.OpenAI(base_url=base, api_key=key, max_retries=0).completions.create(model="policy", prompt="1 + 2 =",
                                                                                     max_tokens=4)
    rec = _close(gateway, sid)
    assert rec.num_turns == 1 and c.usage.completion_tokens == len(rec.response_ids)
    assert c.choices[0].text == tok.decode(rec.response_ids, skip_special_tokens=True)


BAD = [
    ("invalid json", b"{not json", 400, "invalid_json"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ("missing messages", {"model": "policy"}, 400, "missing_messages"),
    ("empty messages", {"model": "policy", "messages": []}, 400, "missing_messages"),
    ("too long", {"model": "policy", "messages": [{"role": "user", "content": "7 " * MAX_LEN}]}, 400,
     "context_length_exceeded"),
    ("max_tokens past the context", {"model": "policy", "messages": [{"role": "user", "content": "x"}],
                                     "max_tokens": MAX_LEN}, 400, "context_length_exceeded"),
    ("n over the limit", {"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 64}, 400,
     "invalid_n"),
]


@pytest.mark.parametrize("what,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_errors(gw, what, body, status, code):
    _, _, _, url = gw
    raw = {"content": body, "headers": {"content-type": "application/json"}}
    kw = raw if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error"


def test_session_errors(gw):
    _, _, gateway, url = gw
    sid, key, base = _open(gateway, "closed")
    one = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(f"{base}/chat/completions", json={**one, "n": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_n"  # a session is one trajectory
    _close(gateway, sid)
    r = httpx.post(f"{base}/chat/completions", json=one, timeout=60)
    assert r.status_code == 410 and r.json()["error"]["code"] == "session_closed"
    r = httpx.post(f"{url}/sessions/s-nope/v1/chat/completions", json=one, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    with pytest.raises(openai.NotFoundError):  # the SDK maps it as for OpenAI itself
        openai.OpenAI(base_url=f"{url}/sessions/s-nope/v1", api_key="k", max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}])
    # a rewritten conversation is refused (not silently mis-recorded)
    sid, key, base = _open(gateway, "rewrite")
    c = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "first"}], max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="rewritten") as e:
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "other"},
                                                            {"role": "assistant", "content": "zzz"},
                                                            {"role": "user", "content": "more"}], max_tokens=3)
    assert e.value.code == "conversation_rewritten"
    rec = _close(gateway, sid)
    assert rec.num_turns == 1 and "conversation_rewritten" in rec.errors[0]


def test_client_disconnect_mid_stream_aborts_the_engine_request(gw):
    _cfg, engine, gateway, url = gw
    before = ray.get(gateway.stats.remote())["aborted"]
    tokens_before = ray.get(engine.stats.remote())["tokens_out"]
    # Long enough that the engine is still sampling when the Gateway notices the client left (it polls every
    # 0.5 s): 450 tokens of the tiny model sometimes finished first on a loaded 2-core machine.
    n = MAX_LEN - 100
    body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": n, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the role chunk: the request is in the engine now
    # the Gateway aborts the request, the engine holds nothing for the gone client, and never sampled all n tokens
    # (the role chunk can come before the engine has the request: wait for the abort, not only for an idle engine)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st, aborted = ray.get(engine.stats.remote()), ray.get(gateway.stats.remote())["aborted"]
        if aborted == before + 1 and st["backend_unfinished"] == 0 and st["inflight"] == 0:
            break
        time.sleep(0.05)
    assert st["backend_unfinished"] == 0 and st["inflight"] == 0, st
    assert aborted == before + 1
    assert st["tokens_out"] - tokens_before < n
    # the same request left to finish does sample all n (so the one above was cut short, not just fast)
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=120)
    assert r.json()["usage"]["completion_tokens"] == n


def test_external_agent_service(gw, tiny_model):
    """A separate agent service (its own process, fixed base URL and key, two LLM calls per task); the rayrl agent
    only forwards the task. Its calls land in the episode's session by conversation prefix, token-exact."""
    _cfg, _, gateway, url = gw
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "sk-fixed-in-its-config",
           "AGENT_MAX_TOKENS": "6"}
    proc = subprocess.Popen([sys.executable, "-m", "examples.external_agent.server", "--port", str(port)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reward = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        reward = RewardActor.options(num_cpus=0).remote("tests.helpers:exact", 10.0, 1)
        ecfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
            "engine.max_model_len": MAX_LEN, "rollout.agent": "examples.external_agent.agent:agent",
            "rollout.agent_config": json.dumps({"service_url": f"http://127.0.0.1:{port}"}),
            "rollout.max_response_length": 256, "data.max_prompt_length": 200}))
        worker = Rollout("test/ext", ecfg, None, gateway, reward)

        async def both():
            return await asyncio.gather(worker.run_task(_task("What is 3 + 4?", "s0/p1/0")),
                                        worker.run_task(_task("What is 5 + 6?", "s0/p2/0")))

        trajs = asyncio.run(both())
        for t in trajs:
            assert t.error is None, t.error
            assert t.num_turns == 2 and t.reward == 0.0 and t.metadata["service_turns"] == 2
            assert [v for _, _, v in _segments(t.loss_mask)] == [1, 0, 1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if reward is not None:
            ray.kill(reward)


def test_in_process_transport_when_http_is_off(gw, tiny_model):
    """gateway.enabled=false: no listener; ctx.llm reaches the same app through Ray calls."""
    from rayrl.rollout import RayTransport

    _cfg, engine, _, _ = gw
    off = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{"engine.max_model_len": MAX_LEN,
                                                                          "gateway.enabled": False}))
    g = GatewayActor.options(num_cpus=0).remote(off, tiny_model, [engine])
    try:
        base = ray.get(g.start.remote(), timeout=60)
        sid, key, base_url = ray.get(g.open_session.remote("ray-transport"))
        assert base_url.startswith(base)

        async def call():
            http = httpx.AsyncClient(transport=RayTransport(g))
            llm = session_client(base_url, key, "policy", 60, http)
            return await llm.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=3)

        reply = asyncio.run(call())
        rec = ray.get(g.close_session.remote(sid))
        assert rec.num_turns == 1 and reply.usage.completion_tokens == len(rec.response_ids)
    finally:
        ray.kill(g)


def test_task_sampling_sets_the_session_defaults(gw, tiny_model):
    """Validation tasks carry their own temperature/top_p (trainer.val_temperature / val_top_p) to the session: an
    agent that passes none samples with them. Greedy ones agree token for token; rollout.temperature=1 on the
    random tiny model does not."""
    import dataclasses

    cfg, _, gateway, _ = gw
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, agent="tests.helpers:plain_agent"))
    worker = Rollout("test/0", cfg, None, gateway, None)

    def runs(sampling):
        out = []
        for k in range(3):
            task = dataclasses.replace(_task(tid=f"s0/p0/{k}"), sampling=sampling)
            traj = asyncio.run(worker.run_task(task))
            assert traj.error is None, traj.error
            out.append(tuple(traj.response_ids))
            # the agent's own spans reach the trace; its "llm" span is dropped for the Gateway's exact one; the
            # worker's session calls bracket the episode
            names = [e["name"] for e in traj.events]
            assert names == ["llm", "tool:lookup", "gateway:open", "gateway:close"] and "events" not in traj.metadata
            ev = {e["name"]: e for e in traj.events}
            assert ev["gateway:open"]["end"] <= ev["llm"]["start"] and ev["llm"]["end"] <= ev["gateway:close"]["start"]
        return out

    # top_p this small keeps only the most likely token: greedy even where the random model's logits nearly tie
    # (temperature 1e-4 alone let two runs of three part ways)
    assert len(set(runs({"temperature": 1e-4, "top_p": 1e-6}))) == 1
    assert len(set(runs({}))) > 1
