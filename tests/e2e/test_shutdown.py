"""Clean shutdown: a driver killed with SIGKILL mid-step leaves no rayrl actor, no engine-core subprocess,
no reward pool process (the seed's `pkill -9 -f ray::WorkerDict` must never be needed); SIGTERM and Ctrl-C end a run
with one line, exit 143 / 130, the trace written and nothing left, a second Ctrl-C at once; the test cluster's stop()
leaves no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT, LocalCluster, alive, run_processes, tiny_overrides, wait_until

pytestmark = pytest.mark.e2e


def test_sigkill_driver_mid_step_leaves_no_process(tiny_model, tmp_path):
    cluster = LocalCluster().start_head(num_cpus=8)
    try:
        env = {**cluster.env, "RAY_ADDRESS": cluster.address, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
        args = tiny_overrides(tiny_model, str(tmp_path / "run"), **{"trainer.total_steps": 20})
        log = open(tmp_path / "driver.log", "w")
        driver = subprocess.Popen([sys.executable, "-m", "rayrl.train", *args], env=env, cwd=tmp_path,
                                  stdout=log, stderr=subprocess.STDOUT)
        seen: dict[int, tuple[float, str]] = {}

        def step_done():
            seen.update(run_processes(cluster))
            return "step 1:" in (tmp_path / "driver.log").read_text() or driver.poll() is not None

        assert wait_until(step_done, timeout=400, interval=1.0), (tmp_path / "driver.log").read_text()[-3000:]
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(1.0)  # now inside step 2
        seen.update(run_processes(cluster))
        titles = " | ".join(t for _, t in seen.values())
        assert "EngineCore" in titles and "ray::" in titles, titles
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        t0 = time.monotonic()
        wait_until(lambda: not alive(seen), timeout=30)
        left = alive(seen)
        assert not left, f"still running {time.monotonic() - t0:.0f}s after SIGKILL: {left}"
    finally:
        cluster.stop()


@pytest.mark.parametrize("sig, background", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-async_save"])
def test_signal_mid_run_stops_cleanly(sig, background, tiny_model, tmp_path):
    """`rayrl train` on its own local Ray gets SIGTERM / SIGINT after step 1: the actors stop, the trace is written, one
    line names the signal, the step and the last checkpoint, exit 128 + signal, and none of its processes is left.
    With trainer.async_save, the checkpoint written beside the signalled step's rollout is committed on the way out."""
    out = tmp_path / "run"
    driver = _train(tiny_model, tmp_path, **{"trainer.save_freq": 1, "trainer.export_hf": False,
                                             "trainer.async_save": background})
    try:
        seen: dict[int, float] = {}
        titles: dict[int, str] = {}  # the latest: a process sets its title (VLLM::EngineCore) after it starts

        def step_done():
            for p in psutil.Process(driver.pid).children(recursive=True):  # its local Ray: raylet, actors, engines
                try:
                    seen.setdefault(p.pid, p.create_time())
                    titles[p.pid] = " ".join(p.cmdline())
                except psutil.Error:
                    pass
            return "step 1: reward" in (tmp_path / "driver.log").read_text() or driver.poll() is not None

        assert wait_until(step_done, timeout=400, interval=1.0), (tmp_path / "driver.log").read_text()[-3000:]
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert any("EngineCore" in t for t in titles.values()), titles
        os.kill(driver.pid, sig)
        rc = driver.wait(timeout=120)
        text = (tmp_path / "driver.log").read_text()
        assert rc == 128 + sig, text[-3000:]
        last = [ln for ln in text.splitlines() if ln.startswith("rayrl: stopped by")]
        assert last and last[-1].startswith(f"rayrl: stopped by {sig.name} at step "), text[-3000:]
        # the checkpoint it names is complete and the newest one (the signal may land in step 2 or later: the
        # older checkpoints are rotated away); with async_save, the one written beside the signalled step's rollout
        # was committed on the way out, not dropped
        named = last[-1].partition("(last checkpoint: ")[2].rstrip(")")
        assert named.startswith(f"{out}/checkpoints/step_"), last[-1]
        steps = sorted(int(p.name.partition("_")[2]) for p in (out / "checkpoints").glob("step_*"))
        assert named == f"{out}/checkpoints/step_{steps[-1]}", (named, steps)
        assert os.path.isfile(os.path.join(named, "COMPLETE")) and "was not completed" not in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert (out / "trace.json").is_file()
        wait_until(lambda: not _alive(seen), timeout=30)
        assert not _alive(seen), _alive(seen)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_a_second_ctrl_c_ends_at_once_and_leaves_no_process(tiny_model, tmp_path):
    """Ctrl-C twice in step 2 (an impatient user): the second one ends the driver at once, exit 130, and takes the
    local Ray it started along (raylet, GCS, agents, actors, engine cores), which a plain exit would leave running."""
    driver = _train(tiny_model, tmp_path)
    try:
        seen: dict[int, float] = {}

        def step_done():
            for p in psutil.Process(driver.pid).children(recursive=True):
                try:
                    seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    pass
            return "step 1: reward" in (tmp_path / "driver.log").read_text() or driver.poll() is not None

        assert wait_until(step_done, timeout=400, interval=1.0), (tmp_path / "driver.log").read_text()[-3000:]
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        os.kill(driver.pid, signal.SIGINT)
        time.sleep(0.5)  # the first one is unwinding the run
        os.kill(driver.pid, signal.SIGINT)
        t0 = time.monotonic()
        rc = driver.wait(timeout=30)
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        text = (tmp_path / "driver.log").read_text()
        assert rc == 130 and "rayrl: SIGINT again: exiting now" in text, text[-3000:]
        wait_until(lambda: not _alive(seen), timeout=30)
        assert not _alive(seen), _alive(seen)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_sigint_while_the_engine_starts_leaves_no_engine_core(tiny_model, tmp_path):
    """Ctrl-C while vLLM loads (its engine core up, no step begun): one line, exit 130, and none of the run's
    processes left. Before, the driver noticed the signal only once the engines had loaded, waited out a 30 s timeout
    on learners still loading, then killed the engine actor, whose VLLM::EngineCore could live on (with its KV
    cache): 33.7 s and an orphan for the default job on the 2-core machine, 6.5 s and none since."""
    driver = _train(tiny_model, tmp_path)
    try:
        seen: dict[int, float] = {}

        def engine_core_up():
            up = False
            for p in psutil.Process(driver.pid).children(recursive=True):
                try:
                    seen.setdefault(p.pid, p.create_time())
                    up |= "EngineCore" in " ".join(p.cmdline())
                except psutil.Error:
                    pass
            return up or driver.poll() is not None

        assert wait_until(engine_core_up, timeout=300, interval=0.5), (tmp_path / "driver.log").read_text()[-3000:]
        assert driver.poll() is None and "step 1:" not in (tmp_path / "driver.log").read_text()
        os.kill(driver.pid, signal.SIGINT)
        rc = driver.wait(timeout=120)
        text = (tmp_path / "driver.log").read_text()
        assert rc == 130 and "rayrl: stopped by SIGINT at step 0" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        wait_until(lambda: not _alive(seen), timeout=30)
        assert not _alive(seen), _alive(seen)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_cluster_stop_stops_every_process_it_started():
    """tests.helpers.LocalCluster.stop(), which every e2e test ends with: nothing of the cluster outlives it, the
    head's Ray client server (`ray.util.client.server`, which does not carry the temp dir) included."""
    cluster = LocalCluster().start_head(num_cpus=2).add_worker(num_cpus=1)
    try:
        procs = {p.pid: p.create_time() for p in cluster.processes()}
        titles = " | ".join(_alive(procs))
        for name in ("gcs_server", "raylet", "ray.util.client.server", "dashboard"):
            assert name in titles, titles
    finally:
        cluster.stop()
    assert not _alive(procs), _alive(procs)


def _train(tiny_model: str, tmp_path, **overrides) -> subprocess.Popen:
    """`rayrl train` of the tiny job (20 steps) on a local Ray of its own, output in tmp_path/run, console in
    tmp_path/driver.log."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    args = tiny_overrides(tiny_model, str(tmp_path / "run"), **{"trainer.total_steps": 20, **overrides})
    log = open(tmp_path / "driver.log", "w")
    return subprocess.Popen([sys.executable, "-m", "rayrl", "train", *args], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)


def _alive(pids: dict[int, float]) -> list[str]:
    left = []
    for pid, created in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(p.cmdline())[:100])
        except psutil.Error:
            pass
    return left
