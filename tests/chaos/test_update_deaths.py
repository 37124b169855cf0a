"""Chaos between rollout and rollout: SIGKILL once step 2's trajectories are all collected, while the learners train
on them and the weights go to the engine.
- the engine: Ray restarts it, and the weight sync (rayrl.recovery.sync) starts it and gives it the new weights (with
  object_store, and with broadcast after forming the process group again); the run completes with every task
  collected once and none failed;
- a learner rank (FSDP, 2 ranks): not restarted (it held the only copy of its shard); the run stops with one line
  naming the rank and the checkpoint a rerun resumes from."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from rayrl.config import load_config
from rayrl.recovery import LearnerLost
from tests.chaos import roles
from tests.helpers import tiny_overrides, wait_until

pytestmark = pytest.mark.chaos
BATCH, N = 4, 4


def collected(n: int) -> bool:
    """The queue has handed out `n` results (since its start) and holds no task: the driver is past collect."""
    import ray

    try:
        s = ray.get(ray.get_actor("rayrl/queue").stats.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - not started yet
        return False
    return s["completed_total"] >= n and s["pending"] == s["leased"] == s["done"] == 0


def kill_after_rollout(out: str, name: str, killed: list, failures: list) -> threading.Thread:
    """SIGKILL `name` once step 2's rollout is collected and step 2 is not logged yet (its update or sync runs)."""

    def run() -> None:
        try:
            if not wait_until(lambda: roles.steps_logged(out) == 1, 300, 0.2):
                raise TimeoutError("step 1 never ended")
            pid = roles.pid(name)  # asked while it is idle: a learner answers no call during its train_step
            if not wait_until(lambda: collected(2 * BATCH * N), 300, 0.05):
                raise TimeoutError("step 2's rollout never ended")
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            failures.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def job(tiny_model: str, out: str, **extra) -> list[str]:
    # several optimizer steps per update: the update lasts long enough for the kill to land in it
    return tiny_overrides(tiny_model, out, **{
        "trainer.total_steps": 3, "trainer.batch_size": BATCH, "rollout.n": N, "trainer.export_hf": False,
        "trainer.save_freq": 1, "learner.ppo_epochs": 4, "learner.mini_batch_size": 2, "trainer.recover_timeout": 120,
        **extra})


@pytest.mark.parametrize("mode", ["object_store", "broadcast"])
def test_an_engine_killed_in_the_update_is_restarted_and_synced(mode, tiny_model, ray_cluster, tmp_path, capfd):
    """broadcast (gloo here, NCCL on GPUs): the restarted engine is a new process, outside the learner -> engines
    group; the group is formed again with it before the sync."""
    from rayrl.train import train

    out = str(tmp_path / "run")
    killed, failures = [], []
    killer = kill_after_rollout(out, "rayrl/engine/0", killed, failures)
    summary = train(load_config(None, job(tiny_model, out, **{"engine.weight_sync": mode})))
    killer.join(timeout=10)
    assert not failures, failures
    assert len(killed) == 1 and summary["step"] == 3
    err = capfd.readouterr().err
    assert "rayrl: engine/0 died and was restarted (started, weights of policy version 2 pushed)" in err
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    # the restart happened inside step 2's sync (an engine's start takes seconds), not in step 3's rollout
    assert steps[1]["sync/seconds"] > 3 * max(steps[0]["sync/seconds"], steps[2]["sync/seconds"]), steps
    count = roles.ledger(out, 3, BATCH * N, BATCH)
    assert (count["collected"], count["lost"], count["duplicated"], count["errors"]) == (3 * BATCH * N, [], [], {})


def test_a_learner_rank_killed_in_the_update_stops_the_run_in_one_line(tiny_model, ray_cluster, tmp_path):
    from rayrl.train import train

    out = str(tmp_path / "run")
    killed, failures = [], []
    killer = kill_after_rollout(out, "rayrl/learner/1", killed, failures)
    with pytest.raises(LearnerLost) as e:
        train(load_config(None, job(tiny_model, out, **{"learner.num_workers": 2})))
    killer.join(timeout=10)
    assert not failures, failures
    ckpt = os.path.join(out, "checkpoints", "step_1")
    assert str(e.value) == (f"learner/1 died during step 2's update; a learner rank holds the only copy of its shard "
                            f"and is not restarted: run again to resume from {ckpt}")
    assert isinstance(e.value, ConnectionError)  # rayrl.cli prints `rayrl: <message>`, exit 1
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step_1"]
