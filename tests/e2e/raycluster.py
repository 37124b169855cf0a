"""A throwaway Ray cluster of `ray start` nodes on this machine, for e2e tests.

Each cluster has its own temp dir and free ports, so it never touches another test's cluster, and
`stop()` kills only the processes it started (found by its temp dir), never `ray stop` (which stops
every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, env: dict[str, str] | None = None):
        # Short: Ray puts unix sockets under it (108-byte path limit).
        self.temp_dir = tempfile.mkdtemp(prefix="rr", dir="/tmp")
        # Token auth (Ray's default) with this cluster's own token: every `ray` command and driver gets this env.
        token = os.path.join(self.temp_dir, "auth_token")
        with open(token, "w") as f:
            f.write(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token, **(env or {})}
        for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
            self.env.pop(k, None)
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.metrics_ports: list[int] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], num_cpus: int, resources: dict | None) -> None:
        metrics = free_port()
        self.metrics_ports.append(metrics)
        cmd = ["ray", "start", f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
               f"--metrics-export-port={metrics}", f"--dashboard-agent-listen-port={free_port()}",
               f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
               f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
               "--node-ip-address=127.0.0.1", *args]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")

    def start_head(self, num_cpus: int = 8, resources: dict | None = None) -> LocalCluster:
        self._start(["--head", f"--port={self.gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={free_port()}"],
                    num_cpus, resources)
        return self

    def add_worker(self, num_cpus: int = 4, resources: dict | None = None) -> LocalCluster:
        self._start([f"--address={self.address}"], num_cpus, resources)
        return self

    def processes(self) -> list[psutil.Process]:
        """This cluster's Ray processes (found by the temp dir in their command line) and all their descendants."""
        roots = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp_dir in a for a in (p.info["cmdline"] or [])):
                    roots.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        found = {p.pid: p for p in roots}
        for p in roots:
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        return list(found.values())

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def descendants_named(roots: list[psutil.Process], *needles: str) -> dict[int, str]:
    """pid -> process title, for descendants of `roots` whose title contains any needle."""
    out = {}
    for r in roots:
        try:
            kids = r.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for c in kids:
            try:
                title = " ".join(c.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if any(n in title for n in needles):
                out[c.pid] = title
    return out


def wait_until(pred, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()
