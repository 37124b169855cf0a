"""The e2b backend through the real `e2b-code-interpreter` SDK against a small fake E2B server on localhost.

The SDK's `api_url` / `sandbox_url` options send both the control API (create / kill sandboxes) and the code
interpreter's streaming `/execute` to the fake server, over plain HTTP. The fake runs each snippet with a real
Python and answers in the interpreter's line-delimited JSON.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("e2b_code_interpreter")

from rayrl.config import SandboxConfig
from rayrl.sandbox import SandboxPool

KEY = "e2b_test_key_0123456789"


class FakeE2B(BaseHTTPRequestHandler):
    log: list[tuple[str, str, str]] = []  # (method, path, api key header)
    created = 0

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
        self.wfile.write(payload)

    def do_POST(self) -> None:  # http.server's naming
        FakeE2B.log.append(("POST", self.path, self.headers.get("X-API-Key", "")))
        body = self._body()
        if self.path == "/v2/sandboxes" or self.path == "/sandboxes":
            FakeE2B.created += 1
            if self.headers.get("X-API-Key") != KEY:
                self._send(401, json.dumps({"code": 401, "message": "bad key"}).encode())
                return
            self._send(201, json.dumps({"templateID": body.get("templateID", "t"), "sandboxID": f"sbx{FakeE2B.created}",
                                        "clientID": "c", "envdVersion": "0.2.0", "envdAccessToken": "tok"}).encode())
        elif self.path == "/execute":
            p = subprocess.run([sys.executable, "-c", body["code"]], capture_output=True, text=True, timeout=30,
                               check=False)
            lines = []
            if p.stdout:
                lines.append({"type": "stdout", "text": p.stdout, "timestamp": 0})
            if p.returncode != 0:
                last = (p.stderr.strip().splitlines() or ["Error: ?"])[-1]
                name, _, value = last.partition(": ")
                lines.append({"type": "error", "name": name, "value": value, "traceback": p.stderr})
            lines.append({"type": "end_of_execution"})
            self._send(200, "".join(json.dumps(x) + "\n" for x in lines).encode(), "application/x-ndjson")
        else:
            self._send(404, b"{}")

    def do_DELETE(self) -> None:
        FakeE2B.log.append(("DELETE", self.path, self.headers.get("X-API-Key", "")))
        self._send(204)


@pytest.fixture
def fake_e2b(monkeypatch):
    FakeE2B.log, FakeE2B.created = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeE2B)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("RAYRL_TEST_E2B_KEY", KEY)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield SandboxConfig(backend="e2b", e2b_api_key_env="RAYRL_TEST_E2B_KEY", e2b_template="code-interpreter-v1",
                        e2b_api_url=url, e2b_sandbox_url=url, max_concurrency=2)
    server.shutdown()
    server.server_close()


def test_runs_reuse_the_sandbox_and_close_kills_it(fake_e2b) -> None:
    async def go():
        pool = SandboxPool(fake_e2b)
        a = await pool.run("print(6 * 7)")
        b = await pool.run("1/0")
        await pool.close()
        return a, b
    a, b = asyncio.run(go())
    assert a.stdout == "42\n" and a.ok, a
    assert b.exit_code == 1 and "ZeroDivisionError" in b.stderr and b.error is None
    creates = [x for x in FakeE2B.log if x[0] == "POST" and "sandboxes" in x[1]]
    assert len(creates) == 1  # the second run reused the sandbox
    assert all(x[2] == KEY for x in creates)  # the key came from the env var named in the config
    assert ("DELETE", "/sandboxes/sbx1") in [(m, p) for m, p, _ in FakeE2B.log]  # close() killed it


def test_a_rejected_key_is_an_error_without_the_key(fake_e2b, monkeypatch) -> None:
    monkeypatch.setenv("RAYRL_TEST_E2B_KEY", "wrong_key_abcdef")

    async def go():
        pool = SandboxPool(fake_e2b)
        r = await pool.run("print(1)")
        await pool.close()
        return r
    r = asyncio.run(go())
    assert r.error and r.error.startswith("e2b: cannot create a sandbox") and "wrong_key_abcdef" not in r.error
