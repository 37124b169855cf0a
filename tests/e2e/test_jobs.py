"""`ray job submit` on a head + worker cluster (two `ray start` nodes on this machine): the job succeeds, each
role runs on the node its placement config asks for, the Dashboard's Prometheus export has the rayrl gauges,
the run leaves a valid trace.json, and `ray job stop` mid-run ends it with one line and its trace and leaves no process
of the run. The cluster is made, the job submitted and stopped with the README's lines as written (read from it here,
so they cannot drift), in a shell whose home already holds a Ray token (as a local run may leave); only HEAD is filled
in and the `ray start` lines get this machine's test ports and temp dir. A fresh home (no token) is tested too."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    LocalCluster,
    alive,
    check_trace_format,
    free_port,
    run_processes,
    tiny_overrides,
    wait_until,
)

pytestmark = pytest.mark.e2e
GAUGES = ["rayrl_reward_mean", "rayrl_step_seconds", "rayrl_rollout_tokens_per_s", "rayrl_queue_depth",
          "rayrl_leases_in_flight", "rayrl_failed_trajectories", "rayrl_sandbox_latency_seconds",
          "rayrl_weight_sync_seconds", "rayrl_policy_version", "rayrl_staleness"]




def readme_lines(path: str, heading: str) -> list[str]:
    """The shell lines of the first bash block after `heading` in `path`: continuations joined, comments dropped."""
    block = Path(ROOT, path).read_text().split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [" ".join(ln.split(" # ", 1)[0].split()) for ln in block.replace("\\\n", " ").splitlines()]
    return [ln for ln in lines if ln]


CLUSTER = readme_lines("README.md", "### Submitting to a cluster")


def readme(prefix: str) -> str:
    return next(ln for ln in CLUSTER if ln.startswith(prefix))


def fill(c: LocalCluster, line: str, **values: str) -> str:
    """A README line with HEAD as this cluster and each placeholder of `values` replaced."""
    line = line.replace("http://HEAD:8265", c.dashboard).replace("HEAD:6379", c.address)
    for k, v in values.items():
        line = line.replace(k, v)
    return line


def sh(c: LocalCluster, line: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], env=c.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def readme_cluster(home: Path, **env: str) -> LocalCluster:
    """Head + worker made with the README's lines in a shell whose HOME is `home` and that sets no RAY_AUTH_* itself."""
    c = LocalCluster(env=env)
    c.env = {k: v for k, v in c.env.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(home)}
    try:
        for line in CLUSTER:
            if line.startswith("export "):
                key, value = line.removeprefix("export ").split("=", 1)
                c.env[key] = value
        p = sh(c, readme("ray get-auth-token"))
        assert p.returncode == 0 and (home / ".ray" / "auth_token").is_file(), p.stdout + p.stderr
        head = shlex.split(readme("ray start --head"))[2:]
        c._start([*head, f"--port={c.gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                  f"--dashboard-port={c.dashboard_port}", f"--ray-client-server-port={free_port()}"], 6, None)
        c._start(shlex.split(fill(c, readme("ray start --address")))[2:], 2, None)
        assert wait_until(lambda: len([n for n in ray_list(c, "nodes") if n["state"] == "ALIVE"]) == 2, 60)
    except BaseException:
        c.stop()
        raise
    return c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # what a plain ray.init() leaves behind
    c = readme_cluster(home, RAY_metrics_report_interval_ms="1000")  # gauges reach Prometheus within ~1 s
    try:
        yield c
    finally:
        c.stop()


def submit_as_written(c: LocalCluster, out: Path, overrides: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """The README's `ray job submit` line (it waits for the job, printing its log) with the tiny model's overrides
    after its own; the process and the job's id."""
    line = fill(c, readme("ray job submit"), **{"/shared/runs/two_nodes": str(out)})
    extra = [a for a in overrides if not a.startswith("trainer.output_dir=")]
    f = log.open("w")
    p = subprocess.Popen(["bash", "-c", f"{line} {shlex.join(extra)}"], env=c.env, cwd=ROOT, stdout=f,
                         stderr=subprocess.STDOUT)
    found = wait_until(lambda: re.search(r"raysubmit_\w+", log.read_text()) or p.poll() is not None, 180)
    assert isinstance(found, re.Match), log.read_text()[-3000:]
    return p, found.group(0)


def ray_cli(c: LocalCluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], env=c.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def ray_list(c: LocalCluster, what: str) -> list[dict]:
    p = ray_cli(c, "list", what, "--address", c.address, "--detail", "--format", "json", "--limit", "10000")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def submit(c: LocalCluster, job_id: str, overrides: list[str]) -> None:
    p = ray_cli(c, "job", "submit", "--address", c.dashboard, "--runtime-env", "runtime_envs/cpu.yaml",
                "--submission-id", job_id, "--no-wait", "--", "python", "-m", "rayrl.train", "jobs/two_nodes.yaml",
                *overrides)
    assert p.returncode == 0, p.stdout + p.stderr


def status(c: LocalCluster, job_id: str) -> str:
    return next((j["status"] for j in ray_list(c, "jobs") if j.get("submission_id") == job_id), "?")


def logs(c: LocalCluster, job_id: str) -> str:
    return ray_cli(c, "job", "logs", "--address", c.dashboard, job_id).stdout


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def test_job_submit_two_nodes(cluster, tiny_model, tmp_path):
    out = tmp_path / "run"
    # 6 short steps: the step gauges live from step 1 until the driver exits; polling `ray list jobs` on a loaded
    # 2-core machine takes seconds, and 2 steps left too short a window to scrape them.
    proc, job = submit_as_written(cluster, out, tiny_overrides(tiny_model, str(out), **{
        "trainer.experiment_name": "e2e", "trainer.total_steps": 6,
        "sandbox.num_actors": 1, "placement.sandbox_resources": "{worker_node: 0.01}"}), tmp_path / "submit.log")
    found: set[str] = set()
    deadline = time.monotonic() + 780  # 6 steps take ~2 min alone, minutes more on a loaded 2-core machine (< 900 s)
    while status(cluster, job) in ("PENDING", "RUNNING", "?") and time.monotonic() < deadline:
        for port in cluster.metrics_ports:  # the driver runs on the head; its gauges are exported there
            text = scrape(port)
            found |= {g for g in GAUGES if f"{g}{{" in text and 'run="e2e"' in text}
        time.sleep(1.0)
    text = logs(cluster, job)
    assert status(cluster, job) == "SUCCEEDED", text[-4000:]
    assert "step 2: reward" in text
    assert proc.wait(timeout=60) == 0 and "step 2: reward" in (tmp_path / "submit.log").read_text()

    # every role on the node its placement asked for (jobs/two_nodes.yaml)
    nodes = {n["node_id"]: n for n in ray_list(cluster, "nodes")}
    head = next(i for i, n in nodes.items() if n["resources_total"].get("head_node"))
    worker = next(i for i, n in nodes.items() if n["resources_total"].get("worker_node"))
    actors = {a["name"]: a for a in ray_list(cluster, "actors") if a.get("name", "").startswith("rayrl/")}
    for name, node in [("rayrl/engine/0", head), ("rayrl/learner/0", head), ("rayrl/rollout/0", worker),
                       ("rayrl/reward/0", worker), ("rayrl/sandbox/0", worker)]:
        assert name in actors, sorted(actors)
        assert actors[name]["node_id"] == node, (name, actors[name]["node_id"], head, worker)
        assert actors[name]["state"] == "DEAD"  # the run stopped its actors when it ended

    assert set(GAUGES) <= found, f"missing from the Prometheus export: {set(GAUGES) - found}"
    check_trace_format(json.loads((out / "trace.json").read_text()))


def test_job_stop_mid_run_leaves_nothing(cluster, tiny_model, tmp_path):
    out = tmp_path / "run"
    submit(cluster, "rayrl-e2e-stop", tiny_overrides(tiny_model, str(out), **{"trainer.total_steps": 50,
                                                                              "trainer.save_freq": 1}))
    seen: dict = {}

    def stepping():
        seen.update(run_processes(cluster))
        return ("step 1:" in logs(cluster, "rayrl-e2e-stop")
                or status(cluster, "rayrl-e2e-stop") not in ("PENDING", "RUNNING"))

    assert wait_until(stepping, timeout=400, interval=2.0)
    assert status(cluster, "rayrl-e2e-stop") == "RUNNING", logs(cluster, "rayrl-e2e-stop")[-4000:]
    seen.update(run_processes(cluster))
    assert any("EngineCore" in t for _, t in seen.values()), seen
    p = sh(cluster, fill(cluster, readme("ray job stop"), JOB_ID="rayrl-e2e-stop"))  # the README's line
    assert p.returncode == 0, p.stdout + p.stderr
    assert wait_until(lambda: status(cluster, "rayrl-e2e-stop") == "STOPPED", 30)
    # the driver unwound (rayrl.stop) within RAY_JOB_STOP_WAIT_TIME_S: one line, the trace written
    text = logs(cluster, "rayrl-e2e-stop")
    assert wait_until(lambda: (out / "trace.json").is_file(), 60), text[-3000:]
    line = next((ln for ln in logs(cluster, "rayrl-e2e-stop").splitlines() if ln.startswith("rayrl: stopped")), text)
    assert line.startswith("rayrl: stopped by SIGTERM at step ") and f"(last checkpoint: {out}/checkpoints/" in line, \
        line[-3000:]
    wait_until(lambda: not alive(seen), timeout=30)
    assert not alive(seen), alive(seen)
    assert not [a for a in ray_list(cluster, "actors")
                if a.get("name", "").startswith("rayrl/") and a["state"] != "DEAD"]


def test_submit_to_no_cluster_fails_clearly(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ""}
    p = subprocess.run(["ray", "job", "submit", "--address", "http://127.0.0.1:1", "--", "python", "-c", "pass"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "127.0.0.1:1" in p.stdout + p.stderr


def test_driver_with_no_cluster_at_its_address_fails_clearly(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rayrl.train", "trainer.ray_address=127.0.0.1:1"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("rayrl: no Ray cluster at 127.0.0.1:1"), p.stderr


def test_runtime_env_that_does_not_parse_fails_clearly(cluster, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("env_vars: {A: [unclosed\n")
    p = ray_cli(cluster, "job", "submit", "--address", cluster.dashboard, "--runtime-env", str(bad), "--",
                "python", "-c", "pass")
    assert p.returncode != 0 and "yaml" in (p.stdout + p.stderr).lower()


def test_job_naming_a_missing_package_fails_clearly(cluster, tiny_model, tmp_path):
    """The job names an agent from a package the cluster does not have: the job FAILS (at config load, before any
    actor starts), `ray job submit` exits non-zero, and the log's last line says which field and what to install."""
    p = ray_cli(cluster, "job", "submit", "--address", cluster.dashboard, "--runtime-env", "runtime_envs/cpu.yaml",
                "--submission-id", "rayrl-e2e-missing", "--", "python", "-m", "rayrl.train", "jobs/two_nodes.yaml",
                *tiny_overrides(tiny_model, str(tmp_path / "run"), **{"rollout.agent": "no_such_pkg_xyz.agents:agent"}),
                timeout=300)
    assert p.returncode != 0, p.stdout + p.stderr
    assert status(cluster, "rayrl-e2e-missing") == "FAILED"
    last = [ln for ln in logs(cluster, "rayrl-e2e-missing").splitlines() if ln.strip()][-1]
    assert last.startswith("rayrl: config error: rollout.agent='no_such_pkg_xyz.agents:agent'"), last
    assert "No module named 'no_such_pkg_xyz'" in last and "runtime_env" in last


def test_readme_cluster_lines_work_on_a_fresh_machine(tiny_model, tmp_path):
    """No token anywhere yet: the README's lines make one, and the job it submits runs (here it stops at once, at its
    config check, naming a package the cluster lacks: enough to show the submission authenticated and ran)."""
    home = tmp_path / "home"
    home.mkdir()
    c = readme_cluster(home)
    try:
        _, job = submit_as_written(c, tmp_path / "run", tiny_overrides(
            tiny_model, str(tmp_path / "run"), **{"rollout.agent": "no_such_pkg_xyz.agents:agent"}), tmp_path / "log")
        assert wait_until(lambda: status(c, job) in ("FAILED", "SUCCEEDED", "STOPPED"), 300)
        text = (tmp_path / "log").read_text() + logs(c, job)
        assert "rayrl: config error: rollout.agent='no_such_pkg_xyz.agents:agent'" in text, text[-3000:]
        assert "Authentication" not in text
    finally:
        c.stop()


def test_jobs_readme_shows_the_readme_cluster_lines():
    """jobs/README.md's cluster lines and its two_nodes submit line are the README's (which the tests above run)."""
    assert readme_lines("jobs/README.md", "## A cluster by hand") == [ln for ln in CLUSTER if "start" in ln
                                                                     or ln.startswith(("export", "ray get-auth"))]
    table = Path(ROOT, "jobs/README.md").read_text()
    assert f"`{readme('ray job submit')}`" in table
