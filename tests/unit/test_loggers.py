"""trainer.logger: console (progress bar + step lines), metrics.jsonl, tensorboard, wandb offline."""

from __future__ import annotations

import json
import os

import pytest

from rayrl.metrics import DASHBOARD, StepLogger, dashboard

M = {"reward/mean": 0.5, "reward/std": 0.1, "time/step_s": 2.0, "policy/version": 1}


def test_console_and_jsonl(tmp_path, capsys):
    log = StepLogger(str(tmp_path), ["console"], total_steps=2, start_step=0, run_config={}, name="t")
    log.log(1, M)
    log.close()
    out = capsys.readouterr().out
    assert "step 1: reward 0.500" in out and "step 2.0s" in out and "v1" in out
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, **M}


GENS = [{"data_source": "aime_2024", "prompt": "What is 2+2?", "response": "\\boxed{4}", "score": 1.0},
        {"data_source": "aime_2025", "prompt": "What is 3+3?", "response": "no idea", "score": None, "error": "boom"}]


def _tb_texts(folder) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("val/generations/text_summary")]


def test_tensorboard_under_the_project_and_run_with_val_generations(tmp_path):
    pytest.importorskip("tensorboard")
    log = StepLogger(str(tmp_path), ["tensorboard"], total_steps=2, start_step=0, run_config={}, name="t",
                     project="retool")
    log.log(1, M)
    log.generations(1, GENS)
    log.close()
    folder = tmp_path / "tensorboard" / "retool" / "t"  # trainer.project_name / experiment_name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(folder))
    [text] = _tb_texts(folder)
    assert "**Input:** What is 2+2?" in text and "**Output:** no idea" in text and "**Score:** 1.0" in text


def test_val_generations_jsonl(tmp_path):
    log = StepLogger(str(tmp_path), ["console"], total_steps=2, start_step=0, run_config={}, name="t")
    log.generations(0, GENS)
    log.generations(5, GENS[:1])
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 0, **GENS[0]}, {"step": 0, **GENS[1]}, {"step": 5, **GENS[0]}]


def test_console_line_shows_validation_accuracy(tmp_path, capsys):
    log = StepLogger(str(tmp_path), ["console"], total_steps=2, start_step=0, run_config={}, name="t")
    log.log(0, {"val-core/aime_2024/acc/mean@30": 0.125})  # validation before training: no step done yet
    assert log.bar.n == 0
    log.log(1, {**M, "val-core/aime_2024/acc/mean@30": 0.25, "val-core/aime_2024/acc/best@30/mean": 0.5})
    assert log.bar.n == 1
    log.close()
    out = capsys.readouterr().out
    assert "step 0: val aime_2024 acc@30 0.125" in out and "val aime_2024 acc@30 0.250" in out


def test_wandb_offline_needs_no_account_and_gets_the_project(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed here")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log = StepLogger(str(tmp_path), ["wandb"], total_steps=2, start_step=0, run_config={"a": 1}, name="t",
                     project="retool")
    assert log.wandb.project == "retool"  # trainer.project_name
    log.log(1, M)
    log.generations(1, GENS)
    log.close()
    assert (tmp_path / "wandb").is_dir()
    tables = list((tmp_path / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json"))
    assert len(tables) == 1 and json.loads(tables[0].read_text())["data"][1][3] == "no idea"


def test_dashboard_gauges_cover_the_issue_list_and_are_a_no_op_outside_ray():
    assert {k for k, _ in DASHBOARD.values()} >= {"reward/mean", "time/step_s", "rollout/tokens_per_s",
                                                   "queue/pending", "queue/leased", "trajectories/failed",
                                                   "sandbox/latency_s", "sync/seconds", "policy/version",
                                                   "policy/staleness_max"}
    dashboard(M, "t")  # no Ray: nothing to do, no error


def test_phase_shares_split_the_step_exclusively():
    """Rollout window [0, 10]: LLM calls [0, 4] and [3, 6]; a sandbox run [5, 7] (overlaps the LLM until 6); reward
    [8, 9]. Then learner 6 s, sync 2 s, and 2 s of other work: a 20 s step."""
    from rayrl.metrics import phase_shares
    from rayrl.types import Trajectory

    def traj(*events):
        return Trajectory(task_id="t", group_id="g", step=0, data_source="d",
                          events=[{"name": n, "start": float(a), "end": float(b)} for n, a, b in events])

    trajs = [traj(("llm", 0, 4), ("sandbox", 5, 7)), traj(("llm", 3, 6), ("reward", 8, 9)),
             traj(("tool:code_interpreter", 11, 12))]  # outside the window: not counted
    s = phase_shares(trajs, start=0.0, rollout_end=10.0, learner_s=6.0, sync_s=2.0, step_s=20.0)
    want = {"generate": 6, "tool": 1, "reward": 1, "rollout_idle": 2, "learner": 6, "sync": 2, "other": 2}
    assert s == pytest.approx({f"time/share_{k}": v / 20 for k, v in want.items()})


def test_step_metrics_split_the_sandbox_run_from_the_wait_and_report_the_loop_lag():
    from rayrl.train import step_metrics
    from rayrl.types import Trajectory

    def traj(spans, lag):
        return Trajectory(task_id="t", group_id="g", step=1, data_source="d", reward=1.0,
                          events=[{"name": "sandbox", "start": 0.0, "end": end, "args": {"run_s": run}}
                                  for end, run in spans],
                          timings={"loop_lag_mean": lag, "loop_lag_max": 2 * lag})

    m = step_metrics([traj([(4.0, 0.1), (2.0, 0.3)], 0.01), traj([(3.0, 0.2)], 0.03)], groups=[], dropped=0,
                     learn={}, t_rollout=10.0, sync_s=0.0, version=1, step_s=12.0)
    assert m["sandbox/latency_s"] == pytest.approx(3.0) and m["sandbox/run_s"] == pytest.approx(0.2)
    assert m["rollout/loop_lag_mean_s"] == pytest.approx(0.02) and m["rollout/loop_lag_max_s"] == pytest.approx(0.06)


def test_rollout_tokens_per_s_of_a_batch_generated_during_earlier_steps():
    """An async step can find its batch already done (collected in 0.01 s): its rate is over the batch's own LLM
    span, not over that collect window (which printed 1.7M tok/s on the H200)."""
    from rayrl.train import step_metrics
    from rayrl.types import Trajectory

    def traj(start, end, n):
        return Trajectory(task_id="t", group_id="g", step=1, data_source="d", reward=1.0, response_ids=[5] * n,
                          loss_mask=[1] * n, events=[{"name": "llm", "start": start, "end": end}])

    trajs = [traj(100.0, 101.0, 300), traj(100.5, 102.0, 300)]
    early = step_metrics(trajs, groups=[], dropped=0, learn={}, t_rollout=0.01, sync_s=0.0, version=2, step_s=1.0)
    assert early["rollout/tokens_per_s"] == pytest.approx(600 / 2.0)  # 100.0 -> 102.0
    waited = step_metrics(trajs, groups=[], dropped=0, learn={}, t_rollout=3.0, sync_s=0.0, version=2, step_s=4.0)
    assert waited["rollout/tokens_per_s"] == pytest.approx(600 / 3.0)  # a synchronous step: its rollout window
