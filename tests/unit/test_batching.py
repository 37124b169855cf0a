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


def test_driver_math_runs_on_one_thread_and_gives_the_threads_back(monkeypatch):
    import torch

    import rayrl.algos

    seen = []
    real = rayrl.algos.grpo_advantages
    monkeypatch.setattr(rayrl.algos, "grpo_advantages", lambda *a, **k: seen.append(torch.get_num_threads())
                        or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        advantages(trainable_groups([traj("a", 0, 1.0), traj("a", 1, 0.0)])[0], norm_by_std=True)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


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


def test_validation_metrics_per_source_with_verls_names_and_a_0_1_accuracy():
    """Two sources at once (AIME 2024 and 2025), math_dapo's +-1 rewards: acc is 1/0, a failed sample counts 0,
    DAPO's overlong penalty is not part of acc; the names and numbers are verl's process_validation_metrics'."""
    from rayrl.metrics import val_metrics

    def v(group, k, reward, answer, source="aime_2024", error=None, penalty=0.0):
        t = traj(group, k, reward, error)
        t.data_source, t.answer = source, answer
        if penalty:
            t.metadata["overlong_penalty"] = penalty
        return t

    trajs = [v("p0", 0, 1.0, "x \\boxed{7}"), v("p0", 1, -1.0, "\\boxed{5}"),
             v("p0", 2, 0.8, "so \\boxed{7}", penalty=-0.2),  # prompt 0: acc 1, 0, 1 -> mean 2/3; majority 7
             v("p1", 0, -1.0, "3"), v("p1", 1, -1.0, "3"), v("p1", 2, None, None, error="boom"),  # acc 0, 0, 0
             v("q0", 0, 1.0, "1", source="aime_2025")]
    m = val_metrics(trajs)
    assert m["val-core/aime_2024/acc/mean@3"] == pytest.approx((2 / 3 + 0) / 2)  # today: the +-1 reward's mean
    assert 0.4 < m["val-core/aime_2024/acc/best@3/mean"] <= 0.5  # prompt 0's best of 3 is 1 unless all draws are 0
    assert 0.3 < m["val-core/aime_2024/acc/maj@3/mean"] <= 0.5
    assert "val-aux/aime_2024/acc/best@2/mean" in m and "val-aux/aime_2024/acc/std@3" in m
    assert m["val-aux/aime_2024/reward/mean@3"] == pytest.approx(0.8 / 3)  # prompt 0's rewards; p1 has 2 (mean@2)
    assert m["val-core/aime_2025/acc/mean@1"] == 1.0 and m["val-aux/failed"] == 1.0
    assert all(0.0 <= x <= 1.0 for k, x in m.items() if "/acc/" in k and "std" not in k)


def test_val_generations_pick_n_deterministically():
    from rayrl.metrics import val_generations

    trajs = [traj(f"p{i}", 0, float(i)) for i in range(5)] + [traj("p9", 0, None, error="boom")]
    for i, t in enumerate(trajs):
        t.prompt_ids = [100 + i]
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    rows = val_generations(trajs, 3, decode)
    assert len(rows) == 3 and len({r["prompt"] for r in rows}) == 3
    assert rows == val_generations(list(reversed(trajs)), 3, decode)  # the order trajectories arrived in: no matter
    assert all(set(r) >= {"data_source", "prompt", "response", "score"} and r["response"] == "10 11 12" for r in rows)
    failed = [r for r in val_generations(trajs, 6, decode) if r["score"] is None]
    assert len(failed) == 1 and failed[0]["error"] == "boom"


def test_tool_metrics():
    from rayrl.metrics import tool_metrics

    a, b = traj("a", 0), traj("a", 1)
    a.metadata, b.metadata = {"tool_calls": 3, "sandbox_errors": 1}, {"tool_calls": 1, "sandbox_errors": 0}
    assert tool_metrics([a, b]) == {"tools/calls_mean": 2.0, "tools/call_rate": 1.0, "sandbox/error_rate": 0.25,
                                    "tools/success_rate": 0.75}
    assert tool_metrics([traj("c", 0)]) == {}
    c = traj("c", 1)
    c.metadata = {"tool_calls": 0}
    assert tool_metrics([a, b, c])["tools/call_rate"] == pytest.approx(2 / 3)  # episodes that called a tool


def test_val_source_takes_one_or_several(tmp_path):
    from rayrl.config import ConfigError, load_config

    a, b = tmp_path / "aime_2024.parquet", tmp_path / "aime_2025.jsonl"
    a.touch(), b.touch()
    assert load_config(None, [f"data.val_source={a}"]).data.val_source == [str(a)]
    assert load_config(None, [f"data.val_source=[{a}, {b}]"]).data.val_source == [str(a), str(b)]
    with pytest.raises(ConfigError, match=r"data.val_source\[1\]: file .*missing.parquet' does not exist"):
        load_config(None, [f"data.val_source=[{a}, {tmp_path}/missing.parquet]"])
