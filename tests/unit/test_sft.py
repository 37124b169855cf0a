"""The SFT step on the plain Learner (this process, world size 1, gloo), the learning-rate schedule against verl's,
and `rayrl sft`'s errors before any actor starts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rayrl.config import load_config
from rayrl.types import TrainBatch

# two conversations as rayrl.sft_data lays them out: a first prompt, then turns; mask 1 = the assistant's tokens
BATCH = TrainBatch(prompt_ids=[[1, 2, 3, 4], [5, 6, 7]], response_ids=[[8, 9, 10, 11, 12, 13], [14, 15]],
                   loss_mask=[[1, 1, 0, 0, 1, 1], [1, 1]], advantages=[[0.0] * 6, [0.0] * 2], global_tokens=6,
                   global_seqs=2)


@pytest.fixture
def learner(tiny_model, request):
    from rayrl.learner import Learner

    cfg = load_config(None, ["learner.lr=1e-2", *getattr(request, "param", [])], check_files=False)
    ln = Learner(tiny_model, cfg)
    ln.setup()
    yield ln
    ln.shutdown()


def _nll_by_hand(learner, batch: TrainBatch) -> float:
    """-log p of every masked target from the model's full logits (float64 log_softmax), token-mean."""
    import torch

    total = 0.0
    with torch.no_grad():
        for p, r, m in zip(batch.prompt_ids, batch.response_ids, batch.loss_mask, strict=True):
            logits = learner.model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1]
            lp = logits.double().log_softmax(-1)[torch.arange(len(r)), torch.tensor(r)]
            total += float(-(lp * torch.tensor(m, dtype=torch.float64)).sum())
    return total / batch.global_tokens


@pytest.mark.parametrize("learner", [["rollout.temperature=0.7", "learner.max_tokens_per_micro_batch=9"]],
                         indirect=True)
def test_sft_loss_is_token_mean_nll_at_temperature_1(learner):
    """Packed token-budget micro-batches (9 tokens: one sequence each) give the whole batch's token-mean -log p of the
    masked tokens, at temperature 1 whatever rollout.temperature is; sft_loss (validation) is the same number."""
    want = _nll_by_hand(learner, BATCH)
    assert learner.sft_loss(BATCH) == pytest.approx(want, abs=1e-5)
    stats = learner.sft_step(BATCH, lr=1e-2)
    assert stats.loss == pytest.approx(want, abs=1e-5) and stats.num_tokens == 6 and stats.grad_norm > 0


def test_sft_steps_lower_the_loss_at_the_given_lr(learner):
    """lr 0 leaves the weights alone (the driver's schedule sets each step's lr); lr > 0 fits the batch."""
    before = learner.send_weights("object_store", 0).arrays["lm_head.weight"].copy()
    first = learner.sft_step(BATCH, lr=0.0).loss
    assert np.array_equal(learner.send_weights("object_store", 1).arrays["lm_head.weight"], before)
    losses = [learner.sft_step(BATCH, lr=1e-2).loss for _ in range(5)]
    assert losses[0] == pytest.approx(first, abs=1e-6) and losses[-1] < 0.5 * first


@pytest.mark.parametrize("warmup,schedule,min_ratio", [(0, "cosine", 0.0), (3, "cosine", 0.1), (4, "constant", 0.0)])
def test_lr_schedule_matches_verl(warmup, schedule, min_ratio):
    import torch
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    from rayrl.sft import lr_at

    cfg = load_config(None, ["learner.lr=2e-5", f"sft.lr_warmup_steps={warmup}", f"sft.lr_schedule={schedule}",
                             f"sft.min_lr_ratio={min_ratio}"], check_files=False)
    total = 10
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-5)
    if schedule == "cosine":
        ref = get_cosine_schedule_with_warmup(opt, warmup, total, min_lr_ratio=min_ratio)
    else:
        ref = get_constant_schedule_with_warmup(opt, warmup)
    want = []
    for _ in range(total):  # verl steps the scheduler after each optimizer step
        opt.step()
        ref.step()
        want.append(opt.param_groups[0]["lr"])
    got = [lr_at(k, total, cfg) for k in range(total)]
    assert got == pytest.approx(want, rel=1e-9)
    assert got[-1] == pytest.approx(2e-5 * (min_ratio if schedule == "cosine" else 1.0), abs=1e-12)
    assert all(not math.isnan(x) and x > 0 for x in got[:-1])


def test_sft_cli_errors_before_any_actor(tiny_model, tmp_path, capsys):
    """A config error or a bad row: one line naming the field / the file and row, exit code 2, no Ray started."""
    import ray

    from rayrl.cli import main

    rows = tmp_path / "rows.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    rows.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "?"}]}) + "\n")
    base = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}/out"]
    assert main(["sft", *base]) == 2
    assert capsys.readouterr().err.strip() == ("rayrl: config error: sft.train_file is required by rayrl sft "
                                               "(a .parquet/.jsonl of messages rows)")
    assert main(["sft", *base, f"sft.train_file={rows}", "sft.batch_size=3", "learner.num_workers=2",
                 "rollout.n=2"]) == 2
    assert "sft.batch_size (3) must be divisible by learner.num_workers (2)" in capsys.readouterr().err
    assert main(["sft", *base, f"sft.train_file={rows}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rayrl: data error: {rows} row 2: the last message must be the assistant's (got user): " \
                  "nothing after it would be trained on"
    assert not ray.is_initialized()
