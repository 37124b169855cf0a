"""The CLI as a user runs it: config errors exit 2 before anything starts; the default job's code path runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, tiny_overrides

BAD = [
    (["trainer.batch_size=6", "learner.mini_batch_size=4"],
     "trainer.batch_size (6) must be divisible by learner.mini_batch_size (4)"),
    (["rollout.agent=nowhere.mod:agent"], "rollout.agent='nowhere.mod:agent'"),
    (["data.source=/no/such/file.parquet"], "data.source: file '/no/such/file.parquet' does not exist"),
    (["trainer.sizee=3"], "unknown config key trainer.sizee"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_config_error_exits_2_with_one_line(overrides, message):
    p = subprocess.run([sys.executable, "-m", "rayrl.train", *overrides], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayrl: config error:") and message in lines[0], p.stderr


def test_bad_data_row_exits_2_before_ray_starts(tmp_path):
    """Before Ray and before the default model is converted (an empty model cache stays empty)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"style": "rule"}, '
                    '"data_source": "x"}\n')
    env = {**os.environ, "RAYRL_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "rayrl", "train", f"data.source={rows}"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 2 and "Ray instance" not in p.stderr, p.stderr
    assert p.stderr.strip() == (f"rayrl: data error: {rows} row 1: reward_model must be a mapping with a "
                                "ground_truth, got {'style': 'rule'}")
    assert not (tmp_path / "cache").exists()


def test_rayrl_train_reports_a_config_error_before_importing_ray_torch_verl():
    code = ("import sys\n"
            "from rayrl.cli import main\n"
            "rc = main(['train', 'jobs/quickstart.yaml', 'trainer.batch_size=6', 'learner.mini_batch_size=4'])\n"
            "print(rc, sorted(m for m in ('ray', 'torch', 'verl', 'vllm') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.stdout.strip() == "2 []", p.stderr
    assert p.stderr.strip() == ("rayrl: config error: trainer.batch_size (6) must be divisible by "
                                "learner.mini_batch_size (4)")


@pytest.mark.e2e
def test_default_job_code_path(tiny_model, tmp_path):
    """`rayrl train jobs/quickstart.yaml` with only the model swapped for the tiny one and the sizes cut down:
    own Ray cluster, CPU vLLM engine, learner, checkpoint, HF export, step lines on the console."""
    out = tmp_path / "quick"
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = tiny_overrides(tiny_model, str(out), **{"trainer.total_steps": 1})
    p = subprocess.run(["rayrl", "train", os.path.join(ROOT, "jobs/quickstart.yaml"), *args], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    text = p.stdout + p.stderr
    assert "step 1: reward" in text and "rollout" in text and "tok/s" in text
    assert f"checkpoint: {out}/checkpoints/step_1" in text and f"Hugging Face model: {out}/hf" in text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert model.config.tie_word_embeddings is False and tok.chat_template
    import json

    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    shares = {k: v for k, v in m.items() if k.startswith("time/share_")}
    phases = ("generate", "tool", "reward", "rollout_idle", "learner", "sync", "other")
    assert set(shares) == {f"time/share_{k}" for k in phases}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["time/share_generate"] > 0 and shares["time/share_learner"] > 0
    assert shares["time/share_reward"] > 0  # the RewardActor scored every answer
    assert m["learner/tokens_per_s"] > 0 and m["time/learner_s"] > 0
