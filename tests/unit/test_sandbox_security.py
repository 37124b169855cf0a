"""The local sandbox against hostile code: each test asserts the attack is contained AND the host is unaffected.

Needs what this machine gives (root: namespaces + a uid per slot); elsewhere the tests that depend on it skip,
saying why. docs/sandbox.md lists which mechanism blocks which attack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from rayrl.config import SandboxConfig
from rayrl.sandbox import ExecResult, SandboxPool

BASE = SandboxConfig(max_concurrency=2, timeout=5.0)


def run(code: str, **cfg) -> tuple[ExecResult, SandboxPool]:
    async def go():
        pool = SandboxPool(dataclasses.replace(BASE, **cfg))
        try:
            return await pool.run(code), pool
        finally:
            await pool.close()
    return asyncio.run(go())


def run_uids(code: str, **cfg) -> tuple[ExecResult, list[int]]:
    """Like run(), also returning the uids the pool's slots ran as."""
    async def go():
        pool = SandboxPool(dataclasses.replace(BASE, **cfg))
        try:
            res = await pool.run(code)
            return res, [pool._backend.uid(i) for i in range(pool.config.max_concurrency)]
        finally:
            await pool.close()
    return asyncio.run(go())


def isolation() -> dict:
    return SandboxPool(BASE).isolation


needs_ns = pytest.mark.skipif(not (isolation().get("net") and isolation().get("mount")),
                              reason=f"namespaces not available here: {isolation().get('reason')}")
needs_uid = pytest.mark.skipif(not isolation().get("uid"), reason="a uid per slot needs root")


def procs_of_uid(uid: int, wait: float = 5.0) -> list[int]:
    """Live (non-zombie) processes of `uid`, polled for up to `wait` s: SIGKILL is delivered asynchronously."""
    deadline = time.monotonic() + wait
    while True:
        pids = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        status = dict(line.split(":", 1) for line in f if ":" in line)
                except OSError:
                    continue
                if int(status["Uid"].split()[1]) == uid and not status["State"].strip().startswith("Z"):
                    pids.append(int(pid))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def host_can_fork() -> bool:
    return subprocess.run(["/bin/true"], timeout=10, check=False).returncode == 0


@needs_uid
def test_fork_bomb_hits_nproc_and_leaves_nothing() -> None:
    code = ("import os, time\n"
            "n = 0\n"
            "while True:\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            continue  # children fork too: a real bomb\n"
            "        n += 1\n"
            "    except OSError:\n"
            "        time.sleep(0.05)  # at RLIMIT_NPROC: wait (lightly) for the timeout\n")
    res, uids = run_uids(code, timeout=2.0, max_processes=16, max_concurrency=1)
    assert res.error and "timeout" in res.error
    assert res.duration < 6
    # after close() the slot's uid owns no process: the whole bomb is gone
    assert procs_of_uid(uids[0]) == []
    assert host_can_fork()


@needs_uid
def test_a_process_that_leaves_the_group_is_reaped() -> None:
    code = ("import subprocess\n"
            "subprocess.Popen(['sleep', '60'], start_new_session=True)  # escapes killpg, holds stdout\n"
            "print('main done')\n")
    res, uids = run_uids(code, max_concurrency=1)
    assert res.stdout == "main done\n" and res.exit_code == 0 and res.duration < 10
    assert procs_of_uid(uids[0]) == []  # the uid reaper killed the escaped sleep


@needs_uid
def test_has_processes_sees_a_uid_process_until_it_is_reaped() -> None:
    """The reaper's check (getpriority(PRIO_USER), one syscall): a forked process that setuid to a uid counts, also
    as a zombie, until its parent waits for it."""
    import signal

    from rayrl.sandbox.local import _has_processes

    uid = 61234
    assert not _has_processes(uid)
    pid = os.fork()
    if pid == 0:  # the child: no exec, as the zygote's runs
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while not _has_processes(uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _has_processes(uid)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        assert _has_processes(uid)  # killed, not yet waited for: a zombie, which still counts
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not _has_processes(uid)


def test_10gb_allocation_fails_inside() -> None:
    res, _ = run("x = bytearray(10 * 1024**3)\nprint('allocated')", memory_mb=512)
    assert res.exit_code != 0 and "allocated" not in res.stdout
    assert "MemoryError" in res.stderr
    assert host_can_fork()


def test_infinite_loop_is_killed_at_the_timeout() -> None:
    t0 = time.perf_counter()
    res, _ = run("while True:\n    pass", timeout=1.0)
    assert res.error == "timeout after 1s" and res.exit_code == -9
    assert time.perf_counter() - t0 < 5


def test_cpu_limit_kills_a_busy_loop() -> None:
    res, _ = run("while True:\n    pass", timeout=30.0, cpu_seconds=1)
    assert res.error and "SIGXCPU" in res.error


@needs_ns
def test_writes_outside_the_work_dir_do_not_reach_the_host(tmp_path) -> None:
    marker = f"/tmp/rayrl-sandbox-escape-{os.getpid()}"
    target = tmp_path / "escaped.txt"
    code = ("import os\n"
            f"for path in [{marker!r}, {str(target)!r}, '/etc/rayrl-escape', '../escape', '/var/tmp/escape']:\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print('blocked', path, type(e).__name__)\n"
            "open('inside.txt', 'w').write('ok')\n"
            "print('inside ok')\n")
    res, _ = run(code)
    assert res.exit_code == 0, res.stderr
    assert "blocked /etc/rayrl-escape" in res.stdout and f"blocked {target}" in res.stdout
    assert "inside ok" in res.stdout
    # /tmp and /var/tmp inside are private tmpfs mounts: a write there succeeds but the host never sees it
    for path in (marker, str(target), "/etc/rayrl-escape", "/var/tmp/escape"):
        assert not os.path.exists(path), path


def test_parent_env_secrets_are_not_visible(monkeypatch) -> None:
    monkeypatch.setenv("RAYRL_TEST_SECRET", "s3cr3t-value")
    code = ("import os\n"
            "print(dict(os.environ))\n"
            "try:\n"
            "    print(open(f'/proc/{os.getppid()}/environ').read())\n"
            "except OSError as e:\n"
            "    print('blocked', type(e).__name__)\n")
    res, _ = run(code)
    assert res.exit_code == 0, res.stderr
    assert "s3cr3t-value" not in res.stdout and "RAYRL_TEST_SECRET" not in res.stdout
    assert os.environ["RAYRL_TEST_SECRET"] == "s3cr3t-value"


@needs_ns
def test_home_files_are_hidden() -> None:
    home = os.path.expanduser("~")
    if not os.access(home, os.W_OK):
        pytest.skip(f"cannot write a test file into {home}")
    fd, secret = tempfile.mkstemp(prefix=".rayrl-test-secret-", dir=home)
    try:
        os.write(fd, b"token=abc123")
        os.close(fd)
        os.chmod(secret, 0o644)  # world-readable: only the mount hides it
        code = (f"import os\nprint(sorted(os.listdir({home!r})))\n"
                f"try:\n    print(open({secret!r}).read())\nexcept OSError as e:\n"
                "    print('blocked', type(e).__name__)\n")
        res, _ = run(code, hide_paths=[home])
        assert res.exit_code == 0, res.stderr
        assert "abc123" not in res.stdout and "blocked FileNotFoundError" in res.stdout
        assert os.path.basename(secret) not in res.stdout
        with open(secret) as f:
            assert f.read() == "token=abc123"
    finally:
        os.unlink(secret)


@needs_ns
def test_no_network_to_a_listening_host_socket() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = ("import socket\n"
                "s = socket.socket(); s.settimeout(2)\n"
                f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
                "except OSError as e:\n    print('blocked', type(e).__name__, e)\n")
        res, _ = run(code)
        assert res.exit_code == 0, res.stderr
        assert "blocked" in res.stdout and "connected" not in res.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host socket
    finally:
        server.close()


@needs_uid
def test_two_pools_never_share_a_uid() -> None:
    async def go():
        a, b = SandboxPool(SandboxConfig(max_concurrency=3)), SandboxPool(SandboxConfig(max_concurrency=3))
        ra, rb = await asyncio.gather(a.run("import os\nprint(os.getuid())"), b.run("import os\nprint(os.getuid())"))
        ua = {a._backend.uid(i) for i in range(3)}
        ub = {b._backend.uid(i) for i in range(3)}
        await a.close()
        await b.close()
        return ra, rb, ua, ub
    ra, rb, ua, ub = asyncio.run(go())
    assert len(ua | ub) == 6 and int(ra.stdout) in ua and int(rb.stdout) in ub


@needs_uid
def test_killing_the_parent_fails() -> None:
    # The pool runs in a child process: if the sandbox could kill its parent, the child dies, not pytest.
    script = ("import asyncio, json\n"
              "from rayrl.config import SandboxConfig\n"
              "from rayrl.sandbox import SandboxPool\n"
              "code = 'import os, signal\\n"
              "for target in (os.getppid(), 1):\\n"
              "    try:\\n        os.kill(target, signal.SIGKILL); print(\"killed\", target)\\n"
              "    except OSError as e:\\n        print(\"blocked\", target, type(e).__name__)\\n"
              "os.kill(-1, signal.SIGKILL)\\n'\n"
              "async def go():\n"
              "    pool = SandboxPool(SandboxConfig(timeout=5))\n"
              "    r = await pool.run(code)\n"
              "    await pool.close()\n"
              "    return r\n"
              "r = asyncio.run(go())\n"
              "print(json.dumps({'stdout': r.stdout, 'exit_code': r.exit_code, 'error': r.error}))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr  # the parent survived
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "killed" not in res["stdout"] and "blocked" in res["stdout"], res
    # kill(-1) reached only processes of the slot's uid (none but the caller, which it skips)
    assert res["exit_code"] == 0 and res["error"] is None


def test_huge_stdout_is_cut_and_the_run_killed() -> None:
    t0 = time.perf_counter()
    res, _ = run("while True:\n    print('x' * 1000)", max_output_bytes=10000, timeout=10.0)
    assert res.error and "output limit" in res.error
    assert len(res.stdout) == 10000
    assert time.perf_counter() - t0 < 5


@needs_uid
def test_a_run_cannot_kill_or_reach_its_zygote() -> None:
    # The run's parent is the slot's zygote (root, in the sandbox's namespaces): signalling it fails, it has no fd
    # of the zygote's, and the same zygote serves the next run.
    code = ("import os, signal\n"
            "try:\n    os.kill(os.getppid(), signal.SIGKILL); print('killed')\n"
            "except OSError as e:\n    print('blocked', type(e).__name__)\n"
            "print(sorted(os.listdir('/proc/self/fd')))\n"
            "try:\n    print(open(f'/proc/{os.getppid()}/environ').read())\n"
            "except OSError as e:\n    print('blocked', type(e).__name__)\n")

    async def go():
        pool = SandboxPool(dataclasses.replace(BASE, max_concurrency=1))
        try:
            first = await pool.run(code)
            zygote = pool._backend._zygotes[0]
            second = await pool.run("import os\nprint(os.getppid())")
            return first, second, zygote.proc.pid, zygote.proc.poll()
        finally:
            await pool.close()
    first, second, zygote_pid, zygote_exit = asyncio.run(go())
    assert first.stdout == "blocked PermissionError\n['0', '1', '2', '3']\nblocked PermissionError\n", first
    assert zygote_exit is None and int(second.stdout) == zygote_pid


@needs_uid
def test_a_forked_python_process_that_leaves_the_group_is_reaped() -> None:
    # Like the test above, but without exec: the escapee is a fork of the run's interpreter.
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(60)\n"
            "    os._exit(0)\n"
            "print('main done')\n")
    res, uids = run_uids(code, max_concurrency=1)
    assert res.stdout == "main done\n" and res.exit_code == 0 and res.duration < 10
    assert procs_of_uid(uids[0]) == []
