"""rayrl.recovery without Ray actors: which failures are infrastructure (re-run) and which are the episode's own."""

from __future__ import annotations

import httpx
import openai
import pytest
import ray.exceptions
from ray.core.generated.common_pb2 import ActorDiedErrorContext

from rayrl.recovery import InfraError, RoleLost, died_in, infra_role
from rayrl.sandbox.result import SandboxUnavailable

REQ = httpx.Request("POST", "http://127.0.0.1:1/sessions/s/v1/chat/completions")


def died(cls: str, actor_id: bytes = b"\0" * 16) -> ray.exceptions.ActorDiedError:
    return ray.exceptions.ActorDiedError(ActorDiedErrorContext(class_name=cls, actor_id=actor_id,
                                                               error_message="the worker process was killed"))


def status(code: int) -> openai.APIStatusError:
    resp = httpx.Response(code, request=REQ, json={"error": {"message": "x"}})
    return openai.APIStatusError("x", response=resp, body=None)


def chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:  # noqa: BLE001 - the test builds the chain an agent would raise
        return e


@pytest.mark.parametrize(("error", "role"), [
    (InfraError("sandbox", "ActorDiedError: ..."), "sandbox"),
    (died("SandboxActor"), "sandbox"),
    (SandboxUnavailable("e2b: 503 after 3 retries"), "sandbox"),
    (died("Engine"), "engine"),
    (ray.exceptions.ActorUnavailableError("the node is unreachable", None), "actor"),
    (httpx.ConnectError("connection refused", request=REQ), "gateway"),  # the Gateway is down
    (openai.APIConnectionError(request=REQ), "gateway"),
    (openai.APITimeoutError(request=REQ), "gateway"),
    (status(500), "engine"),  # the Gateway's answer when the engine call raised
    (status(504), "engine"),  # ... or did not answer within gateway.request_timeout
    # the agent wrapped it: the cause still says which role
    (chained(RuntimeError("tool failed"), died("SandboxActor")), "sandbox"),
    (chained(ValueError("bad reply"), httpx.ReadError("eof", request=REQ)), "gateway"),
])
def test_infrastructure_failures_name_their_role(error: BaseException, role: str) -> None:
    assert infra_role(error) == role


@pytest.mark.parametrize("error", [
    ValueError("the agent's own bug"),
    TimeoutError("the agent timed out"),
    status(400),  # the request was the agent's mistake (a prompt too long, a rewritten conversation)
    status(404),
    status(410),
    ray.exceptions.GetTimeoutError("a ray.get in the agent timed out"),
    chained(KeyError("x"), ValueError("y")),
])
def test_the_episodes_own_failures_are_not_infrastructure(error: BaseException) -> None:
    assert infra_role(error) is None


def test_a_cycle_in_the_exception_chain_ends() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert infra_role(a) is None


def test_role_lost_is_one_line_naming_the_role_and_the_setting() -> None:
    e = RoleLost("engine/0", 300)
    assert str(e) == "engine/0 died and did not come back within trainer.recover_timeout=300s"
    assert isinstance(e, ConnectionError)  # rayrl.cli prints it as `rayrl: <message>`


def test_an_agent_cut_off_while_waiting_for_the_llm_is_noted_by_session() -> None:
    """The worker's transport notes a session whose request was cancelled before its answer came (the agent timed
    out waiting on an engine), and no other."""
    import asyncio

    from rayrl.rollout import WaitingSessions

    async def handler(request: httpx.Request) -> httpx.Response:
        if "slow" in request.url.path:
            await asyncio.sleep(60)
        return httpx.Response(200, json={})

    async def main() -> dict:
        waits = WaitingSessions(httpx.MockTransport(handler))
        async with httpx.AsyncClient(transport=waits, base_url="http://gw") as client:
            await client.post("/sessions/fast/v1/chat/completions", json={})
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.post("/sessions/slow/v1/chat/completions", json={}), 0.2)
        return waits.cut

    assert asyncio.run(main()) == {"slow": True}


class Handle:
    """What `died_in` reads of a Ray actor handle: its actor id."""

    def __init__(self, raw: bytes):
        self._actor_id = ray.ActorID(raw)


def test_the_rank_a_failure_reports_dead_is_named() -> None:
    """A learner rank's ActorDiedError anywhere in the failure's chain names that rank (and only it), without asking
    the rank anything: the driver's one line names it even when Ray is slow to answer for a dead actor."""
    ranks = {"learner/0": Handle(b"\1" * 16), "learner/1": Handle(b"\2" * 16)}
    assert died_in(chained(RuntimeError("update"), died("Learner", b"\2" * 16)), ranks) == ["learner/1"]
    assert died_in(died("Learner", b"\3" * 16), ranks) == []  # another actor's death
    assert died_in(RuntimeError("the update's own error"), ranks) == []
