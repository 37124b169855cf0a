"""`ray job submit` on a head + worker cluster (two `ray start` nodes on this machine): the job succeeds, each
role runs on the node its placement config asks for, the Dashboard's Prometheus export has the rayrl gauges,
the run leaves a valid trace.json, and `ray job stop` mid-run leaves no process of the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helpers import ROOT, LocalCluster, alive, check_trace_format, run_processes, tiny_overrides, wait_until

pytestmark = pytest.mark.e2e
GAUGES = ["rayrl_reward_mean", "rayrl_step_seconds", "rayrl_rollout_tokens_per_s", "rayrl_queue_depth",
          "rayrl_leases_in_flight", "rayrl_failed_trajectories", "rayrl_sandbox_latency_seconds",
          "rayrl_weight_sync_seconds", "rayrl_policy_version", "rayrl_staleness"]


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(env={"RAY_metrics_report_interval_ms": "1000"})  # gauges reach Prometheus within ~1 s
    try:
        c.start_head(num_cpus=6, resources={"head_node": 1}).add_worker(num_cpus=2, resources={"worker_node": 1})
        assert wait_until(lambda: len([n for n in ray_list(c, "nodes") if n["state"] == "ALIVE"]) == 2, 60)
        yield c
    finally:
        c.stop()


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
    submit(cluster, "rayrl-e2e-ok", tiny_overrides(tiny_model, str(out), **{
        "trainer.experiment_name": "e2e", "trainer.total_steps": 6,
        "sandbox.num_actors": 1, "placement.sandbox_resources": "{worker_node: 0.01}"}))
    found: set[str] = set()
    deadline = time.monotonic() + 780  # 6 steps take ~2 min alone, minutes more on a loaded 2-core machine (< 900 s)
    while status(cluster, "rayrl-e2e-ok") in ("PENDING", "RUNNING", "?") and time.monotonic() < deadline:
        for port in cluster.metrics_ports:  # the driver runs on the head; its gauges are exported there
            text = scrape(port)
            found |= {g for g in GAUGES if f"{g}{{" in text and 'run="e2e"' in text}
        time.sleep(1.0)
    text = logs(cluster, "rayrl-e2e-ok")
    assert status(cluster, "rayrl-e2e-ok") == "SUCCEEDED", text[-4000:]
    assert "step 2: reward" in text

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
    submit(cluster, "rayrl-e2e-stop", tiny_overrides(tiny_model, str(tmp_path / "run"), **{"trainer.total_steps": 50}))
    seen: dict = {}

    def stepping():
        seen.update(run_processes(cluster))
        return ("step 1:" in logs(cluster, "rayrl-e2e-stop")
                or status(cluster, "rayrl-e2e-stop") not in ("PENDING", "RUNNING"))

    assert wait_until(stepping, timeout=400, interval=2.0)
    assert status(cluster, "rayrl-e2e-stop") == "RUNNING", logs(cluster, "rayrl-e2e-stop")[-4000:]
    seen.update(run_processes(cluster))
    assert any("EngineCore" in t for _, t in seen.values()), seen
    p = ray_cli(cluster, "job", "stop", "--address", cluster.dashboard, "rayrl-e2e-stop")
    assert p.returncode == 0, p.stdout + p.stderr
    assert wait_until(lambda: status(cluster, "rayrl-e2e-stop") == "STOPPED", 30)
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
