"""From trajectories to learner shards, and the driver's failure check — no Ray."""

from __future__ import annotations

import pytest

from rayrl.batching import advantages, shard, trainable_groups
from rayrl.types import Trajectory


def traj(group: str, k: int, reward: float | None = 1.0, error: str | None = None, n: int = 3) -> Trajectory:
    return Trajectory(task_id=f"{group}/{k}", group_id=group, step=0, data_source="x", prompt_ids=[1, 2],
                      response_ids=list(range(10, 10 + n)), loss_mask=[1] * n, reward=reward, error=error)


def test_failed_members_excluded_and_small_groups_dropped():
    trajs = [traj("a", 0, 1.0), traj("a", 1, 0.0), traj("a", 2, error="RuntimeError: x"),
             traj("b", 0, 1.0), traj("b", 1, error="boom"),  # one success left: no baseline
             traj("c", 0, error="e1"), traj("c", 1, error="e2")]
    groups, dropped = trainable_groups(trajs)
    assert [[t.task_id for t in g] for g in groups] == [["a/0", "a/1"]]
    assert dropped == 2


def test_advantages_use_successful_members_only():
    groups, _ = trainable_groups([traj("a", 0, 1.0), traj("a", 1, 0.0), traj("a", 2, error="x")])
    adv = advantages(groups, norm_by_std=True)
    # rewards [1, 0]: mean 0.5, unbiased std 0.7071 -> +-0.7071 (verl adds 1e-6 to the std)
    assert adv[0] == pytest.approx([0.70710] * 3, abs=1e-4) and adv[1] == pytest.approx([-0.70710] * 3, abs=1e-4)


def test_shard_equal_counts_and_global_totals():
    groups = [[traj("a", 0, 1.0, n=5), traj("a", 1, 0.0, n=2), traj("a", 2, 1.0, n=4)]]
    advs = [[1.0] * 5, [-1.0] * 2, [1.0] * 4]
    shards = shard(groups, advs, 2)
    assert [len(s) for s in shards] == [2, 2]  # 3 sequences -> padded to 2 + 2
    assert all(s.global_tokens == 11 and s.global_seqs == 3 for s in shards)
    trained = sum(sum(m) for s in shards for m in s.loss_mask)
    assert trained == 11  # the padding row is fully masked


def test_all_failed_step_stops_the_run():
    from rayrl.train import check_failures

    class Log:
        lines: list[str] = []

        def info(self, text):
            self.lines.append(text)

    log = Log()
    check_failures([traj("a", 0, error="KeyError: 'x'"), traj("a", 1)], 3, log)
    assert log.lines == ["step 3: 1 of 2 trajectories failed; most common (1x): KeyError: 'x'"]
    with pytest.raises(RuntimeError, match=r"step 4: all 2 trajectories failed; most common error \(2x\): boom"):
        check_failures([traj("a", 0, error="boom"), traj("a", 1, error="boom")], 4, log)


def test_validation_metrics_per_source():
    from rayrl.metrics import val_metrics

    def v(group, k, reward, answer, source="rg/a", error=None):
        t = traj(group, k, reward, error)
        t.data_source, t.answer = source, answer
        return t

    trajs = [v("p0", 0, 1.0, "x <answer>7</answer>"), v("p0", 1, 0.0, "<answer>5</answer>"),
             v("p0", 2, 1.0, "so 7"),  # prompt 0: mean 2/3, best 1, majority answer 7 (twice) -> 1
             v("p1", 0, 0.0, "3"), v("p1", 1, 0.0, "3"), v("p1", 2, None, None, error="boom"),  # mean 0, best 0, maj 0
             v("q0", 0, 1.0, "1", source="rg/b")]
    m = val_metrics(trajs)
    assert m["val/rg/a/mean@3"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["val/rg/a/pass@3"] == pytest.approx(0.5) and m["val/rg/a/maj@3"] == pytest.approx(0.5)
    assert m["val/rg/b/mean@1"] == 1.0 and m["val/failed"] == 1.0
    assert m["val/reward_mean"] == pytest.approx(3 / 7)


def test_tool_metrics():
    from rayrl.metrics import tool_metrics

    a, b = traj("a", 0), traj("a", 1)
    a.metadata, b.metadata = {"tool_calls": 3, "sandbox_errors": 1}, {"tool_calls": 1, "sandbox_errors": 0}
    assert tool_metrics([a, b]) == {"tools/calls_mean": 2.0, "sandbox/error_rate": 0.25}
    assert tool_metrics([traj("c", 0)]) == {}
