"""SandboxPool: results, limits, back-pressure, config errors, the e2b key handling; one small Ray actor test."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayrl.actors.sandbox import ExecResult, SandboxConfig, SandboxFull, SandboxPool


def arun(coro):
    return asyncio.run(coro)


async def run_all(pool: SandboxPool, codes: list[str], **kw) -> list:
    try:
        return await asyncio.gather(*(pool.run(c, **kw) for c in codes), return_exceptions=True)
    finally:
        await pool.close()


def test_stdout_stderr_exit_code() -> None:
    ok, bad = arun(run_all(SandboxPool(), ["print(6 * 7)", "import sys\nprint('out')\nraise ValueError('boom')"]))
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


def test_state_does_not_persist_between_runs() -> None:
    async def go():
        pool = SandboxPool()
        await pool.run("x = 1\nopen('f.txt', 'w').write('1')")
        r = await pool.run("import os\nprint('x' in globals(), os.path.exists('f.txt'))")
        await pool.close()
        return r
    assert arun(go()).stdout == "False False\n"


def test_concurrency_is_bounded() -> None:
    pool = SandboxPool({"max_concurrency": 2, "timeout": 60})  # generous: the machine may be loaded
    code = "import time\nt = time.time()\ntime.sleep(0.4)\nprint(t)"
    t0 = time.perf_counter()
    results = arun(run_all(pool, [code] * 4))
    assert all(r.ok for r in results), results
    starts = sorted(float(r.stdout) for r in results)
    # two waves: the 3rd run starts only after one of the first two ended
    assert starts[2] - starts[0] >= 0.35, starts
    assert time.perf_counter() - t0 >= 0.8


def test_full_queue_is_rejected_at_once() -> None:
    pool = SandboxPool({"max_concurrency": 1, "max_queue": 1})
    results = arun(run_all(pool, ["import time\ntime.sleep(0.5)"] * 3))
    full = [r for r in results if isinstance(r, SandboxFull)]
    assert len(full) == 1 and "sandbox.max_queue=1" in str(full[0])
    assert sum(isinstance(r, ExecResult) and r.ok for r in results) == 2
    assert pool.stats["rejected"] == 1 and pool.stats["runs"] == 2


def test_stderr_is_truncated_too() -> None:
    (r,) = arun(run_all(SandboxPool({"max_output_bytes": 100}), ["import sys\nsys.stderr.write('e' * 5000)"]))
    assert len(r.stderr) == 100 and "stderr" in r.error


def test_background_child_does_not_hold_the_run() -> None:
    # The main process exits; a child it left in its process group must not keep the run open until the timeout.
    code = "import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('done')"
    (r,) = arun(run_all(SandboxPool({"timeout": 20}), [code]))
    assert r.stdout == "done\n" and r.error is None and r.duration < 10


@pytest.mark.parametrize("raw, fragment", [
    ({"backend": "docker"}, "sandbox.backend='docker'"),
    ({"max_concurency": 2}, "unknown sandbox config key 'max_concurency'"),
    ({"timeout": 0}, "sandbox.timeout must be > 0"),
    ({"namespaces": "maybe"}, "sandbox.namespaces='maybe'"),
])
def test_config_errors_name_the_field(raw: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        SandboxConfig.from_dict(raw)
    assert fragment in str(e.value)


def test_e2b_without_key_is_a_clear_error_and_never_shows_the_key(monkeypatch) -> None:
    pytest.importorskip("e2b_code_interpreter")
    monkeypatch.delenv("RAYRL_TEST_E2B_KEY", raising=False)
    pool = SandboxPool({"backend": "e2b", "e2b_api_key_env": "RAYRL_TEST_E2B_KEY"})
    (r,) = arun(run_all(pool, ["print(1)"]))
    assert r.error and "RAYRL_TEST_E2B_KEY" in r.error and "not set" in r.error


@pytest.mark.integration
def test_sandbox_actor(ray_cluster) -> None:
    import ray

    from rayrl.actors.sandbox import ActorSandbox, SandboxActor

    actor = ray.remote(SandboxActor).options(num_cpus=0).remote({"max_concurrency": 1, "max_queue": 0})
    try:
        ray.get(actor.stats.remote(), timeout=60)  # started: calls below arrive in order
        sandbox = ActorSandbox(actor)

        async def go():
            first = asyncio.ensure_future(sandbox.run("import time\ntime.sleep(1.0)\nprint('a')"))
            await asyncio.sleep(0.3)  # the first now holds the only slot
            second = await sandbox.run("print('b')")
            return await first, second
        a, b = arun(go())
        assert a.stdout == "a\n", a
        # max_queue=0 and one slot busy: the second is refused at once, as a result (not a raised error)
        assert b.error and "queue full" in b.error
        stats = ray.get(actor.stats.remote(), timeout=30)
        assert stats["runs"] == 1 and stats["rejected"] == 1
        ray.get(actor.close.remote(), timeout=30)
    finally:
        ray.kill(actor)


def test_runs_from_a_process_with_many_open_files(tmp_path):
    """A Ray actor holds many sockets: fd numbers above the sandbox's NOFILE limit must not break the spawn."""
    import asyncio

    from rayrl.actors.sandbox import SandboxConfig, SandboxPool

    held = [open(tmp_path / f"f{i}", "w") for i in range(200)]
    try:
        pool = SandboxPool(SandboxConfig())
        r = asyncio.run(pool.run("print(6 * 7)"))
        asyncio.run(pool.close())
    finally:
        for f in held:
            f.close()
    assert r.error is None and r.stdout == "42\n", r
