"""SandboxPool: results, limits, back-pressure, config errors, the e2b key handling (the Ray actor:
tests/integration/test_sandbox_actor.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayrl.config import ConfigError, SandboxConfig, load_config
from rayrl.sandbox import ExecResult, SandboxFull, SandboxPool, SandboxUnavailable


def arun(coro):
    return asyncio.run(coro)


async def run_all(pool: SandboxPool, codes: list[str], **kw) -> list:
    try:
        return await asyncio.gather(*(pool.run(c, **kw) for c in codes), return_exceptions=True)
    finally:
        await pool.close()


def test_stdout_stderr_exit_code(capsys) -> None:
    ok, bad = arun(run_all(SandboxPool(), ["print(6 * 7)", "import sys\nprint('out')\nraise ValueError('boom')"]))
    # once per pool, into the actor's log: the path its runs take (zygote or a new interpreter per run)
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("rayrl sandbox:")]
    assert line.startswith("rayrl sandbox: local backend, 4 slots, isolation {") and "'zygote': " in line, line
    assert ok == ExecResult("42\n", "", 0, ok.duration, None) and ok.ok
    assert bad.exit_code == 1 and bad.error is None and not bad.ok
    assert bad.stdout == "out\n" and "ValueError: boom" in bad.stderr


def test_numpy_is_importable_and_bash_runs() -> None:
    pool = SandboxPool()

    async def go():
        a = await pool.run("import numpy as np\nprint(int(np.arange(5).sum()))", timeout=30)
        b = await pool.run("echo $((2 + 3))", language="bash")
        c = await pool.run("puts 1", language="ruby")
        await pool.close()
        return a, b, c
    a, b, c = arun(go())
    assert a.stdout == "10\n", a.stderr
    assert b.stdout == "5\n"
    assert c.error and "not supported" in c.error


@pytest.mark.parametrize("zygote", [True, False])
def test_state_does_not_persist_between_runs(zygote: bool) -> None:
    # One slot: both runs fork from the same zygote (or spawn on the same uid).
    first = ("import json, os, random, sys\n"
             "x = 1\nsys.leak = 1\njson.leak = 1\nos.environ['LEAK'] = '1'\n"
             "open('f.txt', 'w').write('1')\nopen('/tmp/f.txt', 'w').write('1')\n"
             "print(random.random())\n")
    second = ("import json, os, random, sys\n"
              "print('x' in globals(), hasattr(sys, 'leak'), hasattr(json, 'leak'), 'LEAK' in os.environ,\n"
              "      os.path.exists('f.txt'), os.path.exists('/tmp/f.txt'))\n"
              "print(random.random())\n")

    async def go():
        pool = SandboxPool(SandboxConfig(max_concurrency=1, zygote=zygote))
        a = await pool.run(first)
        b = await pool.run(second)
        await pool.close()
        return a, b
    a, b = arun(go())
    assert a.ok and b.ok, (a, b)
    flags, rand = b.stdout.splitlines()
    assert flags == "False False False False False False"
    assert rand != a.stdout.strip()  # a fork reseeds: runs do not share a random sequence


def test_runs_fork_from_a_zygote_that_is_restarted_when_it_dies() -> None:
    async def go():
        pool = SandboxPool(SandboxConfig(max_concurrency=1))
        first = await pool.run("import os\nprint(os.getppid())")
        zygote = pool._backend._zygotes[0]
        assert pool.isolation["zygote"] and int(first.stdout) == zygote.proc.pid
        zygote.proc.kill()  # dies between runs
        zygote.proc.wait()
        second = await pool.run("import os\nprint(os.getppid())")
        # dies during a run: that run fails with a clear error, the next one gets a new zygote
        running = asyncio.ensure_future(pool.run("import time\ntime.sleep(30)", timeout=20))
        await asyncio.sleep(0.5)
        pool._backend._zygotes[0].proc.kill()
        died = await running
        third = await pool.run("print('ok')")
        await pool.close()
        return first, second, died, third
    first, second, died, third = arun(go())
    assert second.ok and second.stdout != first.stdout
    assert died.error and "zygote" in died.error and died.duration < 10, died
    assert third.stdout == "ok\n", third


def test_warm_starts_every_slots_zygote_once_and_runs_fork_from_them(monkeypatch) -> None:
    """sandbox.warm: the pool starts all its slots' zygotes up front; a run that arrives while they start waits for
    its slot's zygote instead of starting a second one, and forks from it."""
    from rayrl.sandbox import local

    started = []

    class Counted(local._Zygote):  # the real zygote, counted
        def __init__(self, *a, **kw):
            started.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(local, "_Zygote", Counted)

    async def go():
        pool = SandboxPool(SandboxConfig(max_concurrency=3, warm=True))
        warming = asyncio.ensure_future(pool.warm())
        await asyncio.sleep(0)  # the starts are under way
        run = await pool.run("import os\nprint(os.getppid())")  # slot 0, mid-warm-up
        await warming
        pids = {slot: z.proc.pid for slot, z in pool._backend._zygotes.items() if z.alive()}
        runs = await run_all(pool, ["import os\nprint(os.getppid())"] * 3)  # closes the pool
        return run, pids, runs
    run, pids, runs = arun(go())
    assert sorted(pids) == [0, 1, 2] and len(set(pids.values())) == 3 and len(started) == 3, (pids, started)
    assert int(run.stdout) == pids[0]  # slot 0's run forked from the warm-up's zygote, not a second one
    assert all(r.ok for r in runs) and {int(r.stdout) for r in runs} <= set(pids.values()), (runs, pids)


def test_falls_back_to_spawning_when_the_zygote_cannot_start(monkeypatch, caplog) -> None:
    from rayrl.sandbox import zygote

    monkeypatch.setattr(zygote, "__file__", "/nonexistent/zygote.py")
    pool = SandboxPool(SandboxConfig(max_concurrency=1))
    with caplog.at_level("WARNING", logger="rayrl.sandbox.local"):
        a, b = arun(run_all(pool, ["print(1)", "print(2)"]))
    assert (a.stdout, b.stdout) == ("1\n", "2\n") and a.ok and b.ok
    warnings = [r for r in caplog.records if "zygote" in r.getMessage()]
    assert len(warnings) == 1 and "spawning" in warnings[0].getMessage()
    assert pool.isolation["zygote"] is False and "no zygote" in pool.isolation["reason"]


def test_a_forked_run_has_only_stdio_its_env_and_a_fresh_main() -> None:
    code = ("import os, sys\n"
            "print(sorted(int(f) for f in os.listdir('/proc/self/fd')))\n"
            "print(sorted(os.environ))\n"
            "print(__name__, __file__, sys.argv, sys.path[0], sorted(k for k in globals() if not k.startswith('__')))\n"
            "print(any(m.startswith(('rayrl', 'pytest', 'zygote')) for m in sys.modules))\n")
    (r,) = arun(run_all(SandboxPool(SandboxConfig(env={"EXTRA": "1"})), [code]))
    assert r.ok, r
    fds, env, main, leaked = r.stdout.splitlines()
    assert fds == "[0, 1, 2, 3]"  # 3: the listdir's own
    assert env == str(sorted(["PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE",
                              "PYTHONUNBUFFERED", "PYTHONHASHSEED", "MPLBACKEND", "OMP_NUM_THREADS",
                              "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "EXTRA"]))
    name, file, argv, path0, names = main.split(" ", 4)
    assert (name, argv, names) == ("__main__", "['main.py']", "['os', 'sys']")  # no global of the zygote's
    assert file == path0 + "/main.py"
    assert leaked == "False"


def test_exit_codes_threads_and_atexit_like_a_fresh_interpreter() -> None:
    codes = ["import sys\nsys.exit(3)", "import sys\nsys.exit('bye')", "x = (",
             ("import atexit, threading, time\natexit.register(lambda: print('atexit'))\n"
              "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\nprint('main')")]
    three, bye, syntax, late = arun(run_all(SandboxPool(), codes))
    assert three.exit_code == 3 and three.error is None
    assert bye.exit_code == 1 and bye.stderr == "bye\n"
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr and "zygote.py" not in syntax.stderr
    assert late.stdout == "main\nthread\natexit\n" and late.exit_code == 0, late


def test_concurrency_is_bounded() -> None:
    pool = SandboxPool(SandboxConfig(max_concurrency=2, timeout=60))  # generous: the machine may be loaded
    code = "import time\nt = time.time()\ntime.sleep(0.4)\nprint(t)"
    t0 = time.perf_counter()
    results = arun(run_all(pool, [code] * 4))
    assert all(r.ok for r in results), results
    starts = sorted(float(r.stdout) for r in results)
    # two waves: the 3rd run starts only after one of the first two ended
    assert starts[2] - starts[0] >= 0.35, starts
    assert time.perf_counter() - t0 >= 0.8


def test_full_queue_is_rejected_at_once() -> None:
    pool = SandboxPool(SandboxConfig(max_concurrency=1, max_queue=1))
    results = arun(run_all(pool, ["import time\ntime.sleep(0.5)"] * 3))
    full = [r for r in results if isinstance(r, SandboxFull)]
    assert len(full) == 1 and "sandbox.max_queue=1" in str(full[0])
    assert sum(isinstance(r, ExecResult) and r.ok for r in results) == 2
    assert pool.stats["rejected"] == 1 and pool.stats["runs"] == 2


def test_stderr_is_truncated_too() -> None:
    pool = SandboxPool(SandboxConfig(max_output_bytes=100))
    (r,) = arun(run_all(pool, ["import sys\nsys.stderr.write('e' * 5000)"]))
    assert len(r.stderr) == 100 and "stderr" in r.error


def test_background_child_does_not_hold_the_run() -> None:
    # The main process exits; a child it left in its process group must not keep the run open until the timeout.
    code = "import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('done')"
    (r,) = arun(run_all(SandboxPool(SandboxConfig(timeout=20)), [code]))
    assert r.stdout == "done\n" and r.error is None and r.duration < 10


@pytest.mark.parametrize("override, fragment", [
    ("sandbox.backend=docker", "sandbox.backend='docker'"),
    ("sandbox.max_concurency=2", "unknown config key sandbox.max_concurency"),
    ("sandbox.timeout=0", "sandbox.timeout must be > 0"),
    ("sandbox.namespaces=maybe", "sandbox.namespaces='maybe'"),
    ("sandbox.max_queue=-1", "sandbox.max_queue must be >= 0"),
])
def test_config_errors_name_the_field(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], check_files=False)
    assert fragment in str(e.value)


def test_the_pool_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="sandbox.backend='docker'"):
        SandboxPool(SandboxConfig(backend="docker"))


def test_e2b_without_key_is_a_clear_error_and_never_shows_the_key(monkeypatch) -> None:
    pytest.importorskip("e2b_code_interpreter")
    monkeypatch.delenv("RAYRL_TEST_E2B_KEY", raising=False)
    pool = SandboxPool(SandboxConfig(backend="e2b", e2b_api_key_env="RAYRL_TEST_E2B_KEY"))
    (r,) = arun(run_all(pool, ["print(1)"]))
    # raised, not an ExecResult: the model must never be trained on the service's failure
    assert isinstance(r, SandboxUnavailable) and "RAYRL_TEST_E2B_KEY" in str(r) and "not set" in str(r)


def test_runs_from_a_process_with_many_open_files(tmp_path):
    """A Ray actor holds many sockets: fd numbers above the sandbox's NOFILE limit must not break the spawn."""
    held = [open(tmp_path / f"f{i}", "w") for i in range(200)]
    try:
        pool = SandboxPool(SandboxConfig())
        r = asyncio.run(pool.run("print(6 * 7)"))
        asyncio.run(pool.close())
    finally:
        for f in held:
            f.close()
    assert r.error is None and r.stdout == "42\n", r


def test_a_cancelled_run_does_not_confuse_the_next_one() -> None:
    async def go():
        pool = SandboxPool(SandboxConfig(max_concurrency=1))
        task = asyncio.ensure_future(pool.run("import time\ntime.sleep(30)\nprint('late')"))
        await asyncio.sleep(0.5)
        task.cancel()
        r = await pool.run("print('next')")
        await pool.close()
        return r
    r = arun(go())
    assert r.stdout == "next\n" and r.ok, r
