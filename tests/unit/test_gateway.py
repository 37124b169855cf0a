"""Gateway logic without Ray or an engine: session binding, prompt building, recording, limits, responses."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest
from ray.exceptions import RayActorError

from rayrl.chat import ApiError, normalize_messages
from rayrl.config import load_config
from rayrl.gateway import Gateway
from rayrl.types import Generation, SessionRecord
from tests.helpers import tiny_overrides

ONE = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_record_is_one_sequence_and_refuses_rewrites():
    rec = SessionRecord("s", "t")
    rec.record(Generation([1, 2, 3], [10, 11], [-0.5, -0.25], "stop", 4))
    rec.record(Generation([1, 2, 3, 10, 11, 7, 8], [12], [-1.0], "length", 5))
    assert rec.prompt_ids == [1, 2, 3] and rec.response_ids == [10, 11, 7, 8, 12]
    assert rec.loss_mask == [1, 1, 0, 0, 1] and rec.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert rec.policy_version == 4 and rec.finish_reason == "length" and [t.env_len for t in rec.turns] == [0, 2]
    with pytest.raises(ValueError, match="rewritten"):
        rec.record(Generation([1, 2, 9], [5], [-1.0], "stop", 5))


@pytest.fixture()
def gw(tiny_model):
    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "engine.max_model_len": 64, "data.max_prompt_length": 40, "rollout.max_response_length": 24}))
    return Gateway(cfg, tiny_model, engines=[])


def test_binding_order_path_key_prefix(gw):
    a, _key_a, url_a = gw.open_session("a", match="What is 1 + 1?")
    b, key_b, _ = gw.open_session("b", match="What is 2 + 2?")
    assert url_a.endswith(f"/sessions/{a}/v1")
    msgs = normalize_messages([{"role": "user", "content": "Q: What is 2 + 2?"}])
    ss = gw.sessions
    assert ss.bind(a, key_b, msgs) is ss.by_id[a]  # path first
    assert ss.bind(None, key_b, []) is ss.by_id[b]  # then key
    assert ss.bind(None, "sk-fixed", msgs) is ss.by_id[b]  # then the task text
    assert ss.bind(None, "sk-fixed", normalize_messages([{"role": "user", "content": "hello"}])) is None
    gw.close_session(a)
    with pytest.raises(ApiError) as e:
        ss.bind(a, None, msgs)
    assert e.value.status == 410
    with pytest.raises(ApiError) as e:
        ss.bind("s-unknown", None, msgs)
    assert e.value.status == 404


def test_sessions_open_and_close_in_batches_and_a_bad_id_fails_alone(gw):
    opened = gw.open_sessions([{"task_id": "a", "budget": 10}, {"task_id": "b", "no_such_field": 1},
                               {"task_id": "c", "temperature": 0.5}])
    (a, _, url_a), bad, (c, _, _) = opened
    assert isinstance(bad, TypeError) and "no_such_field" in str(bad) and url_a.endswith(f"/sessions/{a}/v1")
    assert gw.sessions.by_id[a].budget == 10 and gw.sessions.by_id[c].sampling["temperature"] == 0.5
    closed = gw.close_sessions([c, "s-unknown", a])
    assert [r.task_id for r in (closed[0], closed[2])] == ["c", "a"] and isinstance(closed[1], KeyError)
    assert gw.stats()["open_sessions"] == 0


def test_a_first_prompt_seen_recently_is_encoded_once(gw, tok):
    """The n samples of a task open n sessions with the same first prompt: its text is encoded once (exactly)."""
    ss, texts = gw.sessions, []
    encode = ss.encode
    ss.encode = lambda text: texts.append(text) or encode(text)
    msgs = normalize_messages([{"role": "user", "content": "What is 2 + 2?"}])
    other = normalize_messages([{"role": "user", "content": "What is 3 + 3?"}])
    first = [ss.prompt_ids(gw.sessions.by_id[gw.open_session(f"t{i}")[0]], msgs, None) for i in range(4)]
    want = tok.encode(ss.render(msgs, None, True), add_special_tokens=False)
    assert first == [want] * 4 and len(texts) == 1
    first[0].append(-1)  # a caller's list is its own
    assert ss.prompt_ids(None, msgs, None) == want and len(texts) == 1  # unbound requests share it too
    ss.first_prompts = 1
    ss.prompt_ids(None, other, None)  # evicts the older text
    assert ss.prompt_ids(None, msgs, None) == want and len(texts) == 3


def test_follow_up_prompt_reuses_exact_tokens(gw, tok):
    """Turn 2's prompt = every token of turn 1 (prompt + the engine's sampled ids, which need not be what the
    tokenizer would produce for that text) + the template's tokens for the new messages only."""
    sid, _, _ = gw.open_session("t")
    s = gw.sessions.by_id[sid]
    msgs = normalize_messages([{"role": "user", "content": "What is 12 + 35?"}])
    p1 = gw.sessions.prompt_ids(s, msgs, None)
    sampled = tok.encode("4", add_special_tokens=False) + tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    s.record.record(Generation(p1, sampled, [-0.1] * len(sampled), "stop", 0))
    s.history = msgs + [{"role": "assistant", "content": "47"}]
    call = {"function": {"name": "f", "arguments": {}}}
    follow = msgs + [{"role": "assistant", "content": "47", "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    p2 = gw.sessions.prompt_ids(s, normalize_messages(follow), None)
    assert p2[: len(p1) + len(sampled)] == p1 + sampled
    assert tok.decode(p2[len(p1) + len(sampled):]) == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ApiError) as e:
        gw.sessions.prompt_ids(s, normalize_messages([{"role": "user", "content": "something else"}] + follow[1:]),
                               None)
    assert e.value.code == "conversation_rewritten"


def test_text_prompt_reuses_session_tokens(gw, tok):
    """/v1/completions: a text prompt that starts with the session's decoded tokens keeps those tokens exactly."""
    sid, _, _ = gw.open_session("t")
    s = gw.sessions.by_id[sid]
    p1 = gw.sessions.text_prompt_ids(s, "1 + 2 =")
    sampled = tok.encode(" ", add_special_tokens=False) + tok.encode("3", add_special_tokens=False)
    s.record.record(Generation(p1, sampled, [-0.1] * len(sampled), "stop", 0))
    p2 = gw.sessions.text_prompt_ids(s, "1 + 2 = 3, and 4 + 5 =")
    assert p2[: len(p1) + len(sampled)] == p1 + sampled and tok.decode(p2[len(p1) + len(sampled):]) == ", and 4 + 5 ="
    assert gw.sessions.text_prompt_ids(s, "other") == tok.encode("other", add_special_tokens=False)


def test_limits(gw):
    sid, _, _ = gw.open_session("t", budget=10, max_prompt=40)
    s = gw.sessions.by_id[sid]
    assert gw.sessions.limits(s, [1] * 20, None, 1) == 10  # the trajectory budget caps max_tokens
    assert gw.sessions.limits(None, [1] * 20, None, 1) == 44  # unbound: the rest of the context
    for prompt, max_tokens, n, code in [([1] * 64, None, 1, "context_length_exceeded"),
                                        ([1] * 20, 50, 1, "context_length_exceeded"),
                                        ([1] * 41, None, 1, "context_length_exceeded"),  # data.max_prompt_length
                                        ([1] * 20, None, 2, "invalid_n"), ([1] * 20, 0, 1, "invalid_value")]:
        with pytest.raises(ApiError) as e:
            gw.sessions.limits(s, prompt, max_tokens, n)
        assert e.value.status == 400 and e.value.code == code
    with pytest.raises(ApiError) as e:
        gw.check_model({"model": "gpt-4o"})
    assert e.value.status == 404
    gw.check_model({"model": "policy"})
    gw.check_model({"model": gw.model_path})


def test_response_choice_parses_tool_calls_from_engine_tokens(gw, tok):
    """What the Gateway answers for sampled tokens holding hermes tool calls: OpenAI tool_calls and finish_reason
    tool_calls; a malformed call: the text as content, finish_reason stop, and the error (which the session
    records) — never an exception."""
    def gen(text):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Generation([1], ids, [-0.1] * len(ids), "stop", 0)

    async def built():
        return await gw.tool_parser()

    parser = asyncio.run(built())
    assert type(parser).__name__ == "Hermes2ProToolParser"  # vLLM's, which the CPU build has too
    # parse=True: the request had tools and tool_choice not "none" (chat() decides that)
    choice, err = gw._choice(0, gen("Adding." + ONE), True, parser, False)
    assert err is None and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Adding."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    choice, err = gw._choice(0, gen(bad), True, parser, True)
    assert err and choice["finish_reason"] == "stop" and choice["message"]["content"] == bad
    assert "tool_calls" not in choice["message"] and len(choice["logprobs"]["content"]) == len(gen(bad).token_ids)
    choice, err = gw._choice(0, gen(ONE), False, None, False)  # no tools, or tool_choice none: no parsing
    assert err is None and "tool_calls" not in choice["message"]
    assert gw.counts["parse_errors"] == 1


def test_the_tool_parser_is_built_off_the_event_loop(tiny_model):
    """Importing vLLM's tool parser takes seconds; the Gateway builds it in a thread, so the requests its event loop
    serves meanwhile are not held (on the GPU, all of step 1's first turns once ended together, ~5 s late). In a
    fresh interpreter, where vLLM is not imported yet."""
    code = textwrap.dedent(f"""
        import asyncio, sys, time
        from rayrl.config import load_config
        from rayrl.gateway import Gateway
        from tests.helpers import tiny_overrides
        assert "vllm" not in sys.modules
        gw = Gateway(load_config(None, tiny_overrides({tiny_model!r}, "/tmp/unused")), {tiny_model!r}, engines=[])

        async def main():
            t0 = last = time.perf_counter()
            fut, gaps = gw.tool_parser(), []
            while not gaps or not fut.done():  # the first gap includes the call itself
                await asyncio.sleep(0.01)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()
            print(type(fut.result()).__name__, round(time.perf_counter() - t0, 3), round(max(gaps), 3))

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    name, took, gap = out.stdout.split()[-3:]
    assert name == "Hermes2ProToolParser", out.stderr[-2000:]
    # the build took seconds; the loop ticked all along (a tick longer than 0.5 s would be the import holding it)
    assert float(took) > 0.5 and float(gap) < 0.5, (took, gap)


class _FailingEngine:
    """An engine handle whose generate call fails with `error` (what a Ray call to a dead engine raises)."""

    def __init__(self, error: Exception):
        self.generate = type("Method", (), {"remote": lambda _self, *a: self._fail()})()
        self.error = error

    async def _fail(self):
        raise self.error


@pytest.mark.parametrize("error, traceback", [
    (RayActorError(error_msg="The actor died unexpectedly.\nmore lines"), False),
    (RuntimeError("a bug in the Gateway"), True)])
def test_engine_failure_is_a_500_and_one_log_line(tiny_model, caplog, error, traceback):
    """A dead engine answers the client 500 engine_error and logs one line; any other exception logs its traceback."""
    import asyncio
    import json

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{"gateway.enabled": False}))
    gw = Gateway(cfg, tiny_model, engines=[_FailingEngine(error)])
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with caplog.at_level("WARNING", logger="rayrl.gateway"):
        status, _, out = asyncio.run(gw.request("POST", "/v1/chat/completions",
                                                {"content-type": "application/json"}, body))
    assert status == 500 and json.loads(out)["error"]["code"] == "engine_error"
    [rec] = [r for r in caplog.records if "gateway request failed" in r.getMessage()]
    if traceback:
        assert rec.exc_info is not None
    else:
        assert rec.exc_info is None and rec.getMessage().endswith("RayActorError: The actor died unexpectedly.")
    assert gw.counts["errors_5xx"] == 1


def test_a_turn_sampled_off_the_sessions_temperature_is_counted_and_warned_once(gw, caplog):
    """An agent that sets its own temperature / top_p samples a distribution the learner does not score: counted
    (/health sampling_overrides), one warning per Gateway; the session's own values and unbound requests are quiet."""
    sid, _, _ = gw.open_session("t", temperature=1.0, top_p=1.0)
    s = gw.sessions.by_id[sid]
    with caplog.at_level("WARNING", logger="rayrl.gateway"):
        assert gw._sampling(s, {"temperature": 1.0, "top_p": 1}, 8).temperature == 1.0  # the session's own: quiet
        gw._sampling(None, {"temperature": 0.2}, 8)  # unbound (not trained): quiet
        assert "sampling_overrides" not in gw.counts
        assert gw._sampling(s, {"temperature": 0.7}, 8).temperature == 0.7  # served as asked, but counted
        gw._sampling(s, {"top_p": 0.9}, 8)
    assert gw.stats()["sampling_overrides"] == 2
    [warning] = [r for r in caplog.records if "sampling_overrides" in r.getMessage()]
    assert "temperature=0.7" in warning.getMessage()
