"""NVIDIA's Multi-Process Service (MPS) for the processes that share a GPU (`placement.mps`).

Without MPS the CUDA contexts of the processes on one GPU (colocated vLLM engines and a learner rank) take turns on
it in time slices: a decode step waits out the learner's slice and the other way round. Under MPS their kernels run
side by side through one server per GPU. `MpsDaemon` runs NVIDIA's control daemon (`nvidia-cuda-mps-control -f`) for
one node, with pipe and log folders of this run's own (`pipe_dir`): only processes that carry `env(pipe_dir)` (the
engines and learners) connect to it, nothing else on the host does, and no setting of the card changes (not its
compute mode). A daemon that quits when asked takes its folder with it; one that had to be killed leaves it (its
logs say why). `rayrl.actors.mps.MpsActor` is its Ray shell, one per node.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

CONTROL = "nvidia-cuda-mps-control"


def env(pipe_dir: str) -> dict[str, str]:
    """The environment that makes a CUDA process a client of the daemon at `pipe_dir`."""
    return {"CUDA_MPS_PIPE_DIRECTORY": f"{pipe_dir}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{pipe_dir}/log"}


class MpsDaemon:
    """The MPS control daemon of one node, started in the foreground as this object's child process."""

    def __init__(self, pipe_dir: str, timeout: float = 30.0):
        self.env = env(pipe_dir)
        self.pipe_dir = pipe_dir
        self.timeout = timeout
        self.node = socket.gethostname()
        self._exe = exe = shutil.which(CONTROL)
        if exe is None:
            raise RuntimeError(f"placement.mps: {CONTROL} is not on PATH on node {self.node}: install the NVIDIA "
                               "driver's utilities there, or set placement.mps: false")
        for d in self.env.values():
            os.makedirs(d, exist_ok=True)
        self._env = {**os.environ, **self.env}
        self._out = f"{self.env['CUDA_MPS_LOG_DIRECTORY']}/daemon.out"  # a file: a pipe nobody reads would fill
        with open(self._out, "wb") as out:
            self._proc = subprocess.Popen([exe, "-f"], env=self._env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        # Up once it answers a command on its pipe; it may fail at once (no GPU, another daemon on the folder).
        deadline = time.monotonic() + self.timeout
        while True:
            if self._proc.poll() is not None:
                with open(self._out, errors="replace") as f:
                    err = f.read().strip()
                raise RuntimeError(f"placement.mps: {CONTROL} on node {self.node} exited with "
                                   f"{self._proc.returncode}{': ' + err[-500:] if err else ''}")
            if self.command("get_server_list", check=False) is not None:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"placement.mps: {CONTROL} on node {self.node} did not answer within "
                                   f"{self.timeout:.0f}s")
            time.sleep(0.1)

    def command(self, cmd: str, check: bool = True) -> str | None:
        """Send one control command (`get_server_list`, `quit`...); its output, or None if the daemon did not take it
        (`check=False`)."""
        try:
            out = subprocess.run([self._exe], input=cmd + "\n", env=self._env, capture_output=True, text=True,
                                 timeout=self.timeout)
        except subprocess.TimeoutExpired:
            if check:
                raise
            return None
        if out.returncode != 0:
            if check:
                raise RuntimeError(f"placement.mps: `{cmd}` to {CONTROL} on node {self.node} failed: "
                                   f"{(out.stderr or out.stdout).strip()[-300:]}")
            return None
        return out.stdout

    def clients(self) -> tuple[str, list[int]]:
        """This node's name and the pids of the processes that joined the daemon (through the servers it started for
        them: one per GPU in use)."""
        servers = self.command("get_server_list").split()
        return self.node, [int(p) for s in servers for p in self.command(f"get_client_list {s}").split()]

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> int | None:
        """Ask the daemon to quit (after its clients have gone), then make sure it has; its exit code. The run's
        folder goes once the daemon has quit cleanly."""
        if self._proc.poll() is None:
            self.command("quit", check=False)
            try:
                self._proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._proc.returncode == 0:
            shutil.rmtree(self.pipe_dir, ignore_errors=True)
        return self._proc.returncode
