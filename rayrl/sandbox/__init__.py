"""Code execution for agents (`ctx.sandbox`): one interface, two backends, no Ray (actors/sandbox.py is the shell).

    pool = SandboxPool(SandboxConfig(backend="local"))   # rayrl.config.SandboxConfig: the job's `sandbox` section
    result = await pool.run("print(1 + 1)")              # ExecResult(stdout="2\\n", stderr="", exit_code=0, ...)
    await pool.close()

- pool.py    SandboxPool: at most `max_concurrency` runs at once, at most `max_queue` waiting, one more raises
             `SandboxFull` at once; picks the backend.
- local.py   `local` (default): every run is a fresh process with rlimits, a wall-clock timeout that kills the whole
             process group, an empty environment, and, where the OS allows it (root, or unprivileged user
             namespaces), new network + mount namespaces: no network, a read-only root filesystem, private tmpfs over
             /tmp, /var/tmp, /dev/shm and the home directories, and (as root) a uid of its own per concurrency slot,
             so the run cannot signal the host's processes and a fork bomb hits RLIMIT_NPROC. Runs are forked from a
             per-slot zygote (zygote.py: an interpreter started clean, numpy imported, already in the network
             namespace), so a run costs a fork instead of an interpreter start; where the zygote cannot start, each
             run spawns `python -S` instead. Stateless: every call starts from nothing. What is and is not
             isolated: docs/sandbox.md.
- zygote.py  the local backend's process side (stdlib only, run as a script).
- e2b.py     `e2b`: the `e2b-code-interpreter` SDK (E2B cloud, or Tencent Agent Sandbox), sandboxes reused from a
             pool and renewed, a fresh interpreter context per run, infrastructure errors retried and then raised.
- result.py  ExecResult, what every run returns; SandboxUnavailable, raised when the sandbox service failed.
"""

from rayrl.sandbox.pool import SandboxFull, SandboxPool
from rayrl.sandbox.result import ExecResult, SandboxUnavailable

__all__ = ["ExecResult", "SandboxFull", "SandboxPool", "SandboxUnavailable"]
