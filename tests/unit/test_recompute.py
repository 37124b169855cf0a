"""Activation checkpointing (rayrl.recompute) and learner.reshard_after_forward on the plain Learner (one gloo rank,
packed rows, the tiny tied Qwen3): the same step as without them, and with
model.gradient_checkpointing_keep_attention the attention kernel does not run again in backward, eager or
compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rayrl.config import ConfigError, load_config
from rayrl.recompute import ATTENTION_OPS
from rayrl.types import TrainBatch

# two micro-batches of different sizes (a budget of 12 tokens): the packed path, and a compiled layer's recompile
BATCH = TrainBatch(prompt_ids=[[1, 2, 3, 4], [5, 6, 7], [8, 9]], response_ids=[[8, 9, 10], [11, 12], [13, 14, 15]],
                   loss_mask=[[1, 1, 1], [1, 0], [1, 1, 1]], advantages=[[1.0] * 3, [-1.0] * 2, [0.5] * 3],
                   global_tokens=7, global_seqs=3)


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels rayrl.recompute knows, forward and backward ops apart."""

    supports_higher_order_operators = True  # a compiled checkpoint's recompute runs ops under run_with_rng_state

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                                 torch._C._dispatch_tls_local_exclude_set()):
                return func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in ATTENTION_OPS:
            self.forward += 1
        elif name.removesuffix("_backward") in ATTENTION_OPS:
            self.backward += 1
        return func(*args, **(kwargs or {}))


def _step(model: str, overrides: list[str]) -> dict:
    """One train_step; returns its loss and grad norm, the log-probs after it, and the attention kernels run in each
    micro-batch's backward."""
    from rayrl.learner import Learner

    cfg = load_config(None, ["learner.lr=1e-2", "learner.max_tokens_per_micro_batch=12", *overrides],
                      check_files=False)
    ln = Learner(model, cfg)
    ln.setup()
    calls = []
    backward = torch.Tensor.backward

    def counted(t, *a, **kw):
        with AttentionCalls() as mode:
            backward(t, *a, **kw)
        calls.append((mode.forward, mode.backward))

    try:
        torch.Tensor.backward = counted
        stats = ln.train_step(BATCH)
        return {"loss": stats.loss, "grad_norm": stats.grad_norm, "logprobs": ln.compute_logprobs(BATCH),
                "calls": calls}
    finally:
        torch.Tensor.backward = backward
        ln.shutdown()


@pytest.fixture(scope="module")
def plain(tied_model):
    return _step(tied_model, [])


@pytest.mark.parametrize("overrides, recomputed", [
    (["model.gradient_checkpointing=true"], True),
    # compiled, the recompute runs under run_with_rng_state, whose ops this counter does not see
    (["model.gradient_checkpointing=true", "learner.compile=true"], None),
    (["model.gradient_checkpointing=true", "model.gradient_checkpointing_keep_attention=true"], False),
    (["model.gradient_checkpointing=true", "model.gradient_checkpointing_keep_attention=true",
      "learner.compile=true"], False),  # the compiled backward graph calls the same kernels
    (["learner.reshard_after_forward=true"], False),
])
def test_same_step_as_without(plain, tied_model, overrides, recomputed):
    got = _step(tied_model, overrides)
    assert got["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    for a, b in zip(plain["logprobs"], got["logprobs"], strict=True):
        assert np.allclose(a, b, atol=1e-4)
    # On CPU the packed row attends through sdpa with a block-diagonal mask: one attention kernel per layer and
    # micro-batch, in its fused CPU flash form
    layers = 2  # qwen3-tiny
    assert plain["calls"] == [(0, layers), (0, layers)]  # two micro-batches (12-token budget: 7 + 5, then 5)
    # its backward once per layer, and a checkpointed layer's recompute runs its forward again, or not
    if recomputed is not None:
        assert got["calls"] == [(layers if recomputed else 0, layers)] * 2


def test_keep_attention_needs_checkpointing():
    with pytest.raises(ConfigError, match="model.gradient_checkpointing_keep_attention needs"):
        load_config(None, ["model.gradient_checkpointing_keep_attention=true"], check_files=False)
