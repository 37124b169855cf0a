"""`rayrl sft` end to end on a local Ray with the tiny model: the loss and the validation loss go down, a second run
resumes from the checkpoint, and the Hugging Face folder loads with transformers, carrying the chat template trained
on (model.chat_template=hermes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {
    "name": "code_interpreter", "description": "Run Python code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


def _row(a: int, b: int) -> dict:
    call = {"type": "function", "function": {"name": "code_interpreter",
                                             "arguments": json.dumps({"code": f"print({a} + {b})"})}}
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": str(a + b)},
                         {"role": "assistant", "content": f"The answer is {a + b}."}],
            "tools": TOOLS}


def _sft(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "rayrl.sft", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=900)


def test_sft_trains_resumes_and_exports(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl import templates

    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(_row(a, a + 3)) + "\n" for a in range(8)))
    val.write_text("".join(json.dumps(_row(a, a + 3)) + "\n" for a in range(20, 24)))
    out = tmp_path / "out"
    args = [f"model.path={tiny_model}", "model.chat_template=hermes", f"sft.train_file={train}",
            f"sft.val_file={val}", "sft.batch_size=4", "sft.max_steps=4", "sft.lr_warmup_steps=1",
            "sft.lr_schedule=constant", "learner.lr=3e-3", "learner.max_tokens_per_micro_batch=1024",
            "learner.num_workers=2", f"trainer.output_dir={out}", "trainer.test_freq=2", "trainer.save_freq=2",
            "trainer.val_before_train=true", "trainer.ray_num_cpus=4"]
    p = _sft(args)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    losses = [m["sft/loss"] for m in metrics[1:]]
    vals = [m["sft/val_loss"] for m in metrics if "sft/val_loss" in m]
    assert len(vals) == 3 and vals[-1] < 0.8 * vals[0] and losses[-1] < 0.8 * losses[0], (losses, vals)
    assert [m["sft/lr"] for m in metrics[1:]] == [3e-3] * 4 and metrics[1]["sft/loss_tokens"] > 0
    assert "step 4:" in p.stdout and "loss" in p.stdout and (out / "checkpoints" / "step_4" / "COMPLETE").exists()

    p = _sft([*args, "sft.max_steps=6"])  # the same output_dir: continues from step 4
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stderr and "step_4" in p.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5, 6]
    assert metrics[-1]["sft/val_loss"] < vals[-1]

    hf = out / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.chat_template == templates.tokenizer(tiny_model, "hermes").chat_template
    # the exported weights are the trained ones: their validation loss is the run's last
    import torch

    from rayrl.sft_data import load_examples

    total = n = 0.0
    with torch.no_grad():
        for ex in load_examples(str(val), tok, 4096):
            ids = torch.tensor([ex.prompt_ids + ex.response_ids])
            p_len, mask = len(ex.prompt_ids), torch.tensor(ex.loss_mask, dtype=torch.float64)
            logits = model(input_ids=ids).logits[0, p_len - 1: -1].double()
            lp = logits.log_softmax(-1)[torch.arange(len(ex.response_ids)), torch.tensor(ex.response_ids)]
            total, n = total - float((lp * mask).sum()), n + float(mask.sum())
    assert total / n == pytest.approx(metrics[-1]["sft/val_loss"], rel=1e-3)
