"""A whole worker node dies mid-step: on a head + worker cluster (two `ray start` nodes on this machine) laid out as
jobs/two_nodes.yaml does (engine and learner on the head; rollout worker, RewardActor and sandbox actor on the
worker), every process of the worker node is SIGKILLed while step 2's episodes run, as a lost machine, and a new
worker node joins, as an operator's `ray start` or an autoscaler brings one. The run goes on: its roles come back
on the new node, and from the task ids of its trace every task issued is collected once (0 lost, 0 duplicated, 0
failed trajectories)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.chaos import roles
from tests.helpers import ROOT, LocalCluster, tiny_overrides, wait_until

pytestmark = pytest.mark.chaos

WORKER = {"worker_node": 1}


def test_worker_node_dies_mid_step_and_no_task_is_lost_or_doubled(tiny_model, tmp_path):
    steps, batch, n = 4, 4, 4
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, str(out), **{
        "trainer.total_steps": steps, "trainer.batch_size": batch, "rollout.n": n, "trainer.export_hf": False,
        "rollout.agent": "tests.chaos.roles:agent", "rollout.agent_config": json.dumps({"sleep": 2.0}),
        "rollout.infra_retry_delay": 2, "rollout.infra_retries": 6, "reward.fn": "tests.chaos.roles:score",
        "reward.timeout": 5, "sandbox.num_actors": 1, "sandbox.cpus_per_actor": 0.5, "trainer.recover_timeout": 240,
        "placement.engine_resources": "{head_node: 0.01}", "placement.learner_resources": "{head_node: 0.01}",
        "placement.rollout_resources": "{worker_node: 0.01}", "placement.reward_resources": "{worker_node: 0.01}",
        "placement.sandbox_resources": "{worker_node: 0.01}"})
    c = LocalCluster().start_head(num_cpus=6, resources={"head_node": 1}).add_worker(num_cpus=3, resources=WORKER)
    try:
        with (tmp_path / "driver.log").open("w") as log:
            driver = subprocess.Popen([sys.executable, "-m", "rayrl.train", *overrides,
                                       f"trainer.ray_address={c.address}"],
                                      env=c.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            # step 2's episodes sleep 0-2 s before their LLM call: 1 s after step 1's line, they are in flight
            assert wait_until(lambda: roles.steps_logged(str(out)) >= 1 or driver.poll() is not None, 400, 0.2)
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(1.0)
            assert c.kill_worker(0) >= 3  # raylet, agents and the actors' workers
            c.add_worker(num_cpus=3, resources=WORKER)
            try:
                rc = driver.wait(timeout=600)
            finally:
                driver.kill()
        text = (tmp_path / "driver.log").read_text()
        assert rc == 0, text[-3000:]
        # the node's roles died and came back (their lines), and no trajectory was lost, doubled or failed
        for line in ("rollout worker rollout/0 died", "reward died and was restarted",
                     "sandbox/0 died and was restarted"):
            assert line in text, text[-3000:]
        count = roles.ledger(str(out), steps, batch * n, batch)
        assert count["issued"] == count["collected"] == steps * batch * n
        assert (count["lost"], count["duplicated"], count["errors"]) == ([], [], {})
    finally:
        c.stop()
