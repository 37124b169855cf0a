"""Chaos: during a tiny training run, SIGKILL one role after another (a rollout worker, the RewardActor, a sandbox
actor, the TaskQueue, the Gateway, the engine), each while episodes are in flight, with an agent, a scorer and a
sandbox run that never finish in step 1. Counted from the task ids of the run's trace: every task issued is
collected once (0 lost, 0 duplicated), the only failed trajectories are the three hung episodes (an actor's death is
re-run, never trained as a failure), and the run completes."""

from __future__ import annotations

import json
import threading

import pytest

from rayrl.config import load_config
from tests.chaos import roles
from tests.helpers import tiny_overrides, wait_until

pytestmark = pytest.mark.chaos

FAULTS = ["rayrl/rollout/0", "rayrl/reward/0", "rayrl/sandbox/0", "rayrl/queue", "rayrl/gateway/0", "rayrl/engine/0"]
HANG = {"s0/p0/0": "agent", "s0/p1/0": "reward", "s0/p2/0": "sandbox"}


def test_every_role_dies_mid_step_and_no_task_is_lost_or_doubled(tiny_model, ray_cluster, tmp_path):
    from rayrl.train import train

    out = str(tmp_path / "run")
    steps, batch, n = len(FAULTS) + 1, 4, 4
    cfg = load_config(None, tiny_overrides(tiny_model, out, **{
        "trainer.total_steps": steps, "trainer.batch_size": batch, "rollout.n": n, "trainer.export_hf": False,
        "rollout.agent": "tests.chaos.roles:agent", "rollout.agent_config": json.dumps({"sleep": 1.5, "hang": HANG}),
        "rollout.agent_timeout": 20, "rollout.infra_retry_delay": 2, "rollout.infra_retries": 6,
        "reward.fn": "tests.chaos.roles:score", "reward.timeout": 5,
        "sandbox.num_actors": 1, "sandbox.cpus_per_actor": 0.5, "sandbox.timeout": 3,
        "trainer.recover_timeout": 240}))
    killed: list[tuple[str, int]] = []
    failures: list[BaseException] = []

    def chaos() -> None:
        try:
            for k, name in enumerate(FAULTS):  # one death per step from step 2 on, while its episodes run
                if not wait_until(lambda k=k: roles.steps_logged(out) > k and roles.in_flight() >= 2, 300, 0.2):
                    raise TimeoutError(f"step {k + 2} never had episodes in flight to kill {name} under")
                killed.append((name, roles.kill(name)))
        except BaseException as e:  # noqa: BLE001 - re-raised by the test below
            failures.append(e)

    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    summary = train(cfg)  # the driver in this (main) thread: it owns the signal handlers
    killer.join(timeout=10)
    assert not failures, failures
    assert [name for name, _ in killed] == FAULTS
    assert summary["step"] == steps

    count = roles.ledger(out, steps, batch * n, batch)
    assert count["issued"] == steps * batch * n
    assert (count["lost"], count["duplicated"]) == ([], [])
    assert count["collected"] == count["issued"]
    # only the hung episodes failed, each for its own reason; no actor's death became a failed trajectory
    assert set(count["errors"]) == set(HANG), count["errors"]
    assert "agent timed out" in count["errors"]["s0/p0/0"]
    assert "reward timed out" in count["errors"]["s0/p1/0"]
    assert "sandbox run failed" in count["errors"]["s0/p2/0"]
