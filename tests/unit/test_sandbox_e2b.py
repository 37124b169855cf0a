"""The e2b backend through the real `e2b-code-interpreter` SDK against a small fake E2B server on localhost.

The SDK's `api_url` / `sandbox_url` options send both the control API (create / renew / kill sandboxes) and the code
interpreter's API (contexts, streaming `/execute`) to the fake server, over plain HTTP. The fake keeps each
sandbox's life (it refuses a sandbox past its timeout, as E2B's proxy does), runs each snippet with Python's exec in
the namespace of its code context (the default context's namespace is shared, like a Jupyter kernel's), answers in
the interpreter's line-delimited JSON, and fails on demand (`FakeE2B.faults`).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("e2b_code_interpreter")

from rayrl.agents.tool_agent import agent
from rayrl.config import SandboxConfig
from rayrl.sandbox import SandboxPool, SandboxUnavailable
from tests.helpers import FakeLLM, completion, make_ctx

KEY = "e2b_test_key_0123456789"


class FakeE2B(BaseHTTPRequestHandler):
    log: list[tuple[str, str, str]] = []  # (method, path, api key header)
    bodies: list[tuple[str, dict]] = []  # (path, JSON body) of every POST
    sandboxes: dict[str, float] = {}  # id -> time.monotonic() at which it expires
    contexts: dict[str, dict] = {}  # context id -> the namespace its code runs in
    default_namespace: dict = {}
    faults: dict[str, list] = {}  # route -> what its next requests get: an HTTP status, or "hang" (no answer for 3 s)
    ids = itertools.count(1)  # sandbox ids
    ctx_ids = itertools.count(1)

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def _send(self, code: int, payload: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except BrokenPipeError:  # the client gave up on a run past its timeout
            pass

    def _fault(self, route: str) -> bool:
        """Answer with the route's next scripted fault, if it has one."""
        queue = FakeE2B.faults.get(route)
        if not queue:
            return False
        fault = queue.pop(0)
        if fault == "hang":
            time.sleep(3)
            fault = 504
        self._send(fault, json.dumps({"code": fault, "message": "scripted fault"}).encode())
        return True

    def _alive(self) -> bool:
        """The sandbox of an interpreter request is alive; else answer as E2B's proxy does (502, not found)."""
        sid = self.headers.get("E2b-Sandbox-Id", "")
        if FakeE2B.sandboxes.get(sid, 0) > time.monotonic():
            return True
        self._send(502, json.dumps({"message": f"The sandbox {sid} was not found", "code": 502}).encode())
        return False

    def do_POST(self) -> None:  # http.server's naming
        FakeE2B.log.append(("POST", self.path, self.headers.get("X-API-Key", "")))
        body = self._body()
        FakeE2B.bodies.append((self.path, body))
        if self.path in ("/v2/sandboxes", "/sandboxes"):
            if self._fault("create"):
                return
            if self.headers.get("X-API-Key") != KEY:
                self._send(401, json.dumps({"code": 401, "message": "bad key"}).encode())
                return
            sid = f"sbx{next(FakeE2B.ids)}"
            FakeE2B.sandboxes[sid] = time.monotonic() + body["timeout"]
            self._send(201, json.dumps({"templateID": body.get("templateID", "t"), "sandboxID": sid,
                                        "clientID": "c", "envdVersion": "0.2.0", "envdAccessToken": "tok"}).encode())
        elif self.path.startswith("/sandboxes/") and self.path.endswith("/timeout"):
            sid = self.path.split("/")[2]
            if self._fault("timeout"):
                return
            if FakeE2B.sandboxes.get(sid, 0) <= time.monotonic():
                self._send(404, json.dumps({"code": 404, "message": "not found"}).encode())
                return
            FakeE2B.sandboxes[sid] = time.monotonic() + body["timeout"]
            self._send(204)
        elif self.path == "/contexts":
            if not self._alive() or self._fault("contexts"):
                return
            cid = f"ctx{next(FakeE2B.ctx_ids)}"
            FakeE2B.contexts[cid] = {}
            self._send(200, json.dumps({"id": cid, "language": body.get("language") or "python",
                                        "cwd": "/home/user"}).encode())
        elif self.path == "/execute":
            if not self._alive() or self._fault("execute"):
                return
            namespace = FakeE2B.contexts[body["context_id"]] if body.get("context_id") else FakeE2B.default_namespace
            out = io.StringIO()
            namespace["print"] = lambda *a, sep=" ", end="\n", **_: out.write(sep.join(map(str, a)) + end)
            lines = []
            try:
                exec(body["code"], namespace)  # the fake interpreter
            except Exception as e:  # noqa: BLE001
                lines.append({"type": "error", "name": type(e).__name__, "value": str(e),
                              "traceback": traceback.format_exc()})
            if out.getvalue():
                lines.insert(0, {"type": "stdout", "text": out.getvalue(), "timestamp": 0})
            lines.append({"type": "end_of_execution"})
            self._send(200, "".join(json.dumps(x) + "\n" for x in lines).encode(), "application/x-ndjson")
        else:
            self._send(404, b"{}")

    def do_DELETE(self) -> None:
        FakeE2B.log.append(("DELETE", self.path, self.headers.get("X-API-Key", "")))
        if self.path.startswith("/contexts/"):
            FakeE2B.contexts.pop(self.path.split("/")[2], None)
        elif self.path.startswith("/sandboxes/"):
            FakeE2B.sandboxes.pop(self.path.split("/")[2], None)
        self._send(204)


@pytest.fixture
def fake_e2b(monkeypatch):
    FakeE2B.log, FakeE2B.bodies, FakeE2B.sandboxes, FakeE2B.contexts = [], [], {}, {}
    FakeE2B.default_namespace, FakeE2B.faults = {}, {}
    FakeE2B.ids, FakeE2B.ctx_ids = itertools.count(1), itertools.count(1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeE2B)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("RAYRL_TEST_E2B_KEY", KEY)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield SandboxConfig(backend="e2b", e2b_api_key_env="RAYRL_TEST_E2B_KEY", e2b_template="code-interpreter-v1",
                        e2b_api_url=url, e2b_sandbox_url=url, max_concurrency=2, e2b_backoff=0.05)
    server.shutdown()
    server.server_close()


def run(config: SandboxConfig, *calls, pause: float = 0.0):
    """Each call (code, or (code, timeout)) on one pool, `pause` seconds apart; the results, then the pool."""
    async def go():
        pool = SandboxPool(config)
        out = []
        try:
            for i, call in enumerate(calls):
                if i and pause:
                    await asyncio.sleep(pause)
                code, timeout = call if isinstance(call, tuple) else (call, None)
                out.append(await pool.run(code, timeout=timeout))
        finally:
            await pool.close()
        return out, pool
    return asyncio.run(go())


def requests(method: str, prefix: str) -> list[str]:
    return [p for m, p, _ in FakeE2B.log if m == method and p.startswith(prefix)]


def creates() -> int:
    return len([p for m, p, _ in FakeE2B.log if m == "POST" and p in ("/sandboxes", "/v2/sandboxes")])


def test_runs_reuse_the_sandbox_and_close_kills_it(fake_e2b) -> None:
    (a, b), _ = run(fake_e2b, "print(6 * 7)", "1/0")
    assert a.stdout == "42\n" and a.ok, a
    assert b.exit_code == 1 and "ZeroDivisionError" in b.stderr and b.error is None
    creates = [x for x in FakeE2B.log if x[0] == "POST" and "sandboxes" in x[1]]
    assert len(creates) == 1  # the second run reused the sandbox
    assert all(x[2] == KEY for x in creates)  # the key came from the env var named in the config
    assert requests("DELETE", "/sandboxes/") == ["/sandboxes/sbx1"]  # close() killed it


def test_every_run_starts_in_a_fresh_interpreter_context(fake_e2b) -> None:
    (a, b), _ = run(fake_e2b, "secret = 41", "print(secret + 1)")
    assert a.ok and b.exit_code == 1 and "NameError" in b.stderr  # another episode's variable is not there
    executes = [body for path, body in FakeE2B.bodies if path == "/execute"]
    assert len(executes) == 2 and all(body["context_id"] for body in executes)
    assert len({body["context_id"] for body in executes}) == 2
    assert len(requests("DELETE", "/contexts/")) == 2 and not FakeE2B.contexts  # each removed after its run


def test_each_tool_agent_episode_starts_in_a_fresh_interpreter(fake_e2b) -> None:
    # two episodes of the tool agent on one pool (one sandbox): the second cannot see what the first defined
    first = FakeLLM([completion("Define it.", [("code_interpreter", {"code": "secret = 41\nprint(secret)"})]),
                     completion("\\boxed{41}")])
    second = FakeLLM([completion("Use it.", [("code_interpreter", {"code": "print(secret + 1)"})]),
                      completion("\\boxed{42}")])

    async def go():
        pool = SandboxPool(fake_e2b)
        try:
            return [await agent(make_ctx(llm, pool), {}) for llm in (first, second)]
        finally:
            await pool.close()
    a, b = asyncio.run(go())
    assert a["metadata"]["tool_calls"] == 1 and a["metadata"]["code_errors"] == 0
    assert b["metadata"]["code_errors"] == 1
    seen = second.requests[1]["messages"][-1]  # the tool result the model got in the second episode
    assert seen["role"] == "tool" and "NameError" in seen["content"], seen
    assert first.requests[1]["messages"][-1]["content"].strip() == "41"
    assert creates() == 1  # the sandbox was reused; only the interpreter context was new


def test_the_timeout_reaches_the_run(fake_e2b) -> None:
    fake_e2b.timeout = 1.0
    t0 = time.monotonic()
    # the case: a run longer than 10 s under a longer timeout is not cut at 10 s
    (cut, fine, after), _ = run(fake_e2b, "import time\ntime.sleep(3)\nprint('late')",
                                ("import time\ntime.sleep(10.5)\nprint('done')", 12.0), "print('next')")
    assert cut.error == "timeout after 1s" and cut.exit_code is None and cut.duration < 2.0, cut
    assert fine.ok and fine.stdout == "done\n", fine  # a run's own timeout beats the section's, both ways
    assert after.ok and time.monotonic() - t0 < 16  # the sandbox stays usable: only the context went
    assert creates() == 1


def test_a_sandbox_is_renewed_before_its_life_ends(fake_e2b) -> None:
    fake_e2b.sandbox_timeout = 20  # < timeout + RENEW_MARGIN: renewed before each reuse
    (a, b), _ = run(fake_e2b, "print(1)", "print(2)")
    assert a.ok and b.ok
    renewals = [(path, body) for path, body in FakeE2B.bodies if path.endswith("/timeout")]
    assert renewals == [("/sandboxes/sbx1/timeout", {"timeout": 20})]
    assert creates() == 1  # renewed, not replaced


def test_an_expired_sandbox_is_replaced(fake_e2b) -> None:
    fake_e2b.sandbox_timeout = 1
    (a, b), _ = run(fake_e2b, "print(1)", "print(2)", pause=1.3)
    assert a.ok and b.ok, b
    assert not [p for p, _ in FakeE2B.bodies if p.endswith("/timeout")]  # too late to renew: replaced
    # sbx1 killed when found expired, sbx2 (its replacement) by close(); no run was sent to the dead one
    assert requests("DELETE", "/sandboxes/") == ["/sandboxes/sbx1", "/sandboxes/sbx2"]
    assert len(requests("POST", "/execute")) == 2


def test_a_sandbox_gone_behind_our_back_is_retried_on_a_new_one(fake_e2b) -> None:
    async def go():
        pool = SandboxPool(fake_e2b)
        try:
            first = await pool.run("print(1)")
            FakeE2B.sandboxes["sbx1"] = 0.0  # the service ended it early
            return first, await pool.run("print(2)")
        finally:
            await pool.close()
    first, second = asyncio.run(go())
    assert first.ok and second.ok and second.stdout == "2\n"
    assert creates() == 2
    assert requests("DELETE", "/sandboxes/")[0] == "/sandboxes/sbx1"  # the dead one was dropped


def test_5xx_is_retried_with_backoff(fake_e2b) -> None:
    fake_e2b.e2b_backoff = 0.2
    FakeE2B.faults = {"execute": [503, 500, 502]}  # 502: E2B's proxy for a sandbox it lost
    t0 = time.monotonic()
    (r,), pool = run(fake_e2b, "print('ok')")
    assert r.ok and r.stdout == "ok\n"
    assert time.monotonic() - t0 >= 0.2 + 0.4 + 0.8  # three failures: waits of 0.2, 0.4, 0.8 s
    assert len(requests("POST", "/execute")) == 4 and creates() == 4  # each retry on a new sandbox
    assert pool.stats["unavailable"] == 0


def test_a_persistent_failure_raises_and_is_never_tool_output(fake_e2b) -> None:
    fake_e2b.e2b_retries = 2
    FakeE2B.faults = {"execute": [503] * 10}
    pool = SandboxPool(fake_e2b)
    with pytest.raises(SandboxUnavailable, match=r"e2b: running the code: SandboxException: 503.*3 attempts"):
        asyncio.run(pool.run("print(1)"))
    assert pool.stats["unavailable"] == 1 and len(requests("POST", "/execute")) == 3

    # through the tool agent: the episode raises (the rollout worker makes it a failed trajectory)
    FakeE2B.faults = {"execute": [503] * 10}
    llm = FakeLLM([completion("Run it.", [("code_interpreter", {"code": "print(1)"})]), completion("\\boxed{1}")])

    async def episode():
        p = SandboxPool(fake_e2b)
        try:
            return await agent(make_ctx(llm, p), {})
        finally:
            await p.close()
    with pytest.raises(SandboxUnavailable):
        asyncio.run(episode())
    assert len(llm.requests) == 1  # the model never saw the service's error


def test_a_service_that_does_not_answer_times_out_and_raises(fake_e2b) -> None:
    fake_e2b.e2b_request_timeout = 0.5
    fake_e2b.e2b_retries = 1
    FakeE2B.faults = {"contexts": ["hang", "hang"]}
    t0 = time.monotonic()
    pool = SandboxPool(fake_e2b)
    with pytest.raises(SandboxUnavailable, match="creating a code context"):
        asyncio.run(pool.run("print(1)"))
    assert time.monotonic() - t0 < 2.5  # 2 x 0.5 s + backoff, not the fake's 3 s hang


def test_a_rejected_key_raises_at_once_without_the_key(fake_e2b, monkeypatch) -> None:
    monkeypatch.setenv("RAYRL_TEST_E2B_KEY", "wrong_key_abcdef")
    pool = SandboxPool(fake_e2b)
    with pytest.raises(SandboxUnavailable, match="e2b: cannot create a sandbox") as err:
        asyncio.run(pool.run("print(1)"))
    assert "wrong_key_abcdef" not in str(err.value)
    assert len(requests("POST", "/")) == 1  # not retried
