"""The plain Learner (LearnerActor's class) in this process (world size 1, gloo): step, KL to the reference,
entropy, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from rayrl.config import load_config
from rayrl.types import TrainBatch

BATCH = TrainBatch(prompt_ids=[[1, 2, 3, 4], [5, 6, 7]], response_ids=[[8, 9, 10], [11, 12]],
                   loss_mask=[[1, 1, 1], [1, 0]], advantages=[[1.0] * 3, [-1.0] * 2], global_tokens=4, global_seqs=2)


@pytest.fixture
def learner(tiny_model, request):
    from rayrl.learner import Learner

    cfg = load_config(None, ["learner.lr=1e-2", *getattr(request, "param", [])], check_files=False)
    ln = Learner(tiny_model, cfg)
    ln.setup()
    yield ln
    ln.shutdown()


def test_step_loss_and_update(learner):
    before = learner.send_weights("object_store", 0).arrays["lm_head.weight"].copy()
    stats = learner.train_step(BATCH)
    # on-policy ratio 1: token-mean of -A over the 4 trained tokens = -(1 + 1 + 1 - 1) / 4
    assert stats.loss == pytest.approx(-0.5, abs=1e-6) and stats.num_tokens == 4 and stats.grad_norm > 0
    after = learner.send_weights("object_store", 1).arrays["lm_head.weight"]
    assert np.abs(after - before).max() == pytest.approx(1e-2, rel=1e-3)  # AdamW's first step moves by ~lr


@pytest.mark.parametrize("learner", [["algo.use_kl_loss=true", "algo.kl_loss_coef=1.0"]], indirect=True)
def test_kl_to_reference(learner):
    first, second = learner.train_step(BATCH), learner.train_step(BATCH)
    assert first.extra["kl_loss"] == 0.0  # the policy starts equal to its reference
    assert second.extra["kl_loss"] > 0.0


def _entropy_by_hand(learner, batch: TrainBatch, temperature: float) -> float:
    """Token-mean over the loss mask of -sum(p log p), p from a float64 log_softmax over each sequence's full logits."""
    import torch

    total = 0.0
    with torch.no_grad():
        for p, r, m in zip(batch.prompt_ids, batch.response_ids, batch.loss_mask, strict=True):
            logits = learner.model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]
            logp = (logits.double() / temperature).log_softmax(-1)
            total += float((-(logp.exp() * logp).sum(-1) * torch.tensor(m, dtype=torch.float64)).sum())
    return total / batch.global_tokens


@pytest.mark.parametrize("learner", [["rollout.temperature=0.7"]], indirect=True)
def test_entropy_is_logged_not_trained_on_by_default(learner):
    want = _entropy_by_hand(learner, BATCH, 0.7)
    stats = learner.train_step(BATCH)
    assert want > 0 and stats.entropy == pytest.approx(want, abs=1e-5)
    assert stats.loss == pytest.approx(-0.5, abs=1e-6)  # algo.entropy_coeff 0: the loss of test_step_loss_and_update


@pytest.mark.parametrize("learner", [["algo.entropy_coeff=0.1"]], indirect=True)
def test_entropy_coeff_subtracts_the_entropy(learner):
    """verl's entropy bonus: pg_loss - entropy_coeff x entropy aggregated by loss_agg_mode (token-mean here, the
    logged value)."""
    stats = learner.train_step(BATCH)
    assert stats.entropy > 0 and stats.loss == pytest.approx(-0.5 - 0.1 * stats.entropy, abs=1e-6)


def test_checkpoint_round_trip(learner, tmp_path):
    learner.train_step(BATCH)
    learner.save(str(tmp_path))
    saved = learner.compute_logprobs(BATCH)
    learner.train_step(BATCH)
    assert learner.compute_logprobs(BATCH) != saved
    learner.load(str(tmp_path))
    assert learner.compute_logprobs(BATCH) == saved


@pytest.mark.parametrize("learner", [["trainer.async_save=true"]], indirect=True)
def test_a_background_save_holds_the_state_it_was_called_with(learner, tmp_path):
    """trainer.async_save: save() returns while a thread copies the state; calls that only read the weights (a
    forward pass, a weight sync) go on beside the copy, and the next optimizer step waits for it, so steps taken while
    the write runs do not reach the checkpoint; written() waits for the write, and a second save waits for the
    first's. The copy is held back here until after save() returned, so that a step that did not wait would change
    what it copies."""
    import os
    import threading

    for d in "ab":
        (tmp_path / d).mkdir()  # rayrl.checkpoint.begin's temp dir
    make, release = learner._staging, threading.Event()

    def held_back():
        stager = make()
        copy = stager._stage
        stager._stage = lambda state, **kw: (release.wait(60), copy(state, **kw))[1]
        return stager

    learner._staging = held_back
    learner.train_step(BATCH)
    learner.save(str(tmp_path / "a"), background=True)
    assert not learner._writing.staging_completion.done()  # save() did not wait for the copy
    saved = learner.compute_logprobs(BATCH)
    packet = learner.send_weights("object_store", 1)
    assert not learner._writing.staging_completion.done()  # nor did the reads
    threading.Timer(0.5, release.set).start()
    learner.train_step(BATCH)  # while the write may still run
    learner.save(str(tmp_path / "b"), background=True)  # waits for a's write first
    learner.train_step(BATCH)
    learner.written()
    assert learner._writing is None and os.path.exists(tmp_path / "a" / "learner" / ".metadata")
    learner.written()  # nothing to wait for
    learner.load(str(tmp_path / "a"))
    assert learner.compute_logprobs(BATCH) == saved
    assert all(np.array_equal(v, packet.arrays[k]) for k, v in learner.send_weights("object_store", 2).arrays.items())
    learner.load(str(tmp_path / "b"))
    assert learner.compute_logprobs(BATCH) != saved


@pytest.mark.parametrize("learner", [["learner.micro_batch_size=1"]], indirect=True)
def test_step_records_trace_spans(learner):
    """Forward and backward per micro-batch, then the optimizer step, all inside the call (rayrl.trace draws them)."""
    events = learner.train_step(BATCH).events
    assert [e["name"] for e in events] == ["forward", "backward", "forward", "backward", "optimizer_step", "train_step"]
    assert [e["args"].get("micro_batch") for e in events[:4]] == [0, 0, 1, 1]
    outer = events[-1]
    for e in events:
        assert outer["start"] <= e["start"] <= e["end"] <= outer["end"] and e["rank"] == 0
    for a, b in zip(events[:-1], events[1:-1], strict=False):  # one after another
        assert a["end"] <= b["start"]


def test_cached_local_views_follow_optimizer_steps_and_loads(learner, tmp_path):
    """cuda_ipc on one rank copies from views of the parameters cached at the first sync: they must show every
    later step's weights (the optimizer updates in place) and a checkpoint load's, never a stale copy."""
    import torch

    from rayrl.weight_sync import layout

    def fresh():
        return {k: v.clone() for k, v in layout.full_tensors(learner.model)}

    learner.compute_logprobs(BATCH)  # a forward without backward must not leave the parameters gathered
    cached = list(layout.full_tensors(learner.model))  # one rank: views of the parameters, what cuda_ipc keeps
    assert [k for k, _ in cached] == list(fresh())
    learner.save(str(tmp_path))
    before = fresh()
    learner.train_step(BATCH)
    after = fresh()
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    for name, t in cached:
        assert torch.equal(t, after[name]), name
    learner.load(str(tmp_path))  # the learner drops its cached list here; whatever it rebuilds must match the load
    rebuilt = list(layout.full_tensors(learner.model))
    for name, t in rebuilt:
        assert torch.equal(t, before[name]), name


def test_compiled_learner_matches_eager(tiny_model):
    """learner.compile (torch.compile of each decoder layer and of the log-prob kernels, dynamic shapes) computes
    the same log-probs and the same update as the eager learner, over micro-batches of different sizes."""
    from torch._dynamo.utils import counters

    from rayrl.learner import Learner

    out = {}
    counters.clear()
    for compiled in (False, True):
        cfg = load_config(None, ["learner.lr=1e-2", "learner.max_tokens_per_micro_batch=8",
                                 f"learner.compile={compiled}"], check_files=False)
        ln = Learner(tiny_model, cfg)
        ln.setup()
        try:
            lp0 = ln.compute_logprobs(BATCH)
            stats = ln.train_step(BATCH)
            out[compiled] = (lp0, stats.loss, stats.grad_norm, ln.compute_logprobs(BATCH))
        finally:
            ln.shutdown()
    (lp0, loss, gn, lp1), (clp0, closs, cgn, clp1) = out[False], out[True]
    assert np.allclose(lp0[0] + lp0[1], clp0[0] + clp0[1], atol=1e-5)
    assert loss == pytest.approx(closs, abs=1e-6) and gn == pytest.approx(cgn, rel=1e-4)
    assert np.allclose(lp1[0] + lp1[1], clp1[0] + clp1[1], atol=1e-4)
    assert not np.allclose(lp0[0], lp1[0], atol=1e-3)  # the step moved the weights, in both
    assert counters["stats"]["unique_graphs"] >= 3  # a decoder layer's forward and both log-prob kernels compiled


def test_warm_up_compiles_what_the_first_step_needs(tiny_model):
    """learner.compile's warm-up (run beside the first rollout): afterwards a real step and a log-prob pass compile
    nothing new, and the warm-up changed nothing: the step equals a learner's without it."""
    import torch
    from torch._dynamo.utils import counters

    from rayrl.learner import Learner

    # three micro-batches of 7, 5 and 5 tokens: sizes the warm-up's synthetic batches do not have
    batch = TrainBatch(prompt_ids=[[1, 2, 3, 4], [5, 6, 7], [8, 9]], response_ids=[[8, 9, 10], [11, 12], [13, 14, 15]],
                       loss_mask=[[1, 1, 1], [1, 0], [1, 1, 1]], advantages=[[1.0] * 3, [-1.0] * 2, [0.5] * 3],
                       global_tokens=7, global_seqs=3)
    out, compiled_in_step = {}, {}
    for warm in (False, True):
        torch._dynamo.reset()  # each learner compiles from nothing, as a new actor process does
        cfg = load_config(None, ["learner.lr=1e-2", "learner.max_tokens_per_micro_batch=7", "learner.compile=true"],
                          check_files=False)
        ln = Learner(tiny_model, cfg)
        ln.setup()
        try:
            if warm:
                assert ln.warm_up()["seconds"] > 0
            before = counters["stats"]["unique_graphs"]
            stats = ln.train_step(batch)
            logprobs = ln.compute_logprobs(batch)  # the old log-probs' pass (no gradients, eval mode)
            compiled_in_step[warm] = counters["stats"]["unique_graphs"] - before
            out[warm] = (stats.loss, stats.grad_norm, logprobs)
        finally:
            ln.shutdown()
    assert compiled_in_step[False] >= 3  # without it the step compiles (a layer, the log-prob kernels)
    assert compiled_in_step[True] == 0
    (loss, gn, lp), (wloss, wgn, wlp) = out[False], out[True]
    assert loss == pytest.approx(wloss, abs=1e-6) and gn == pytest.approx(wgn, rel=1e-5)
    for a, b in zip(lp, wlp, strict=True):
        assert np.allclose(a, b, atol=1e-5)


def test_warm_up_is_nothing_without_compile(learner):
    assert learner.warm_up() == {}
