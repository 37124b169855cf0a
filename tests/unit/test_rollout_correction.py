"""algo.rollout_correction (verl's rollout_corr, decoupled mode) against numbers worked out by hand: truncated IS at
token and sequence level, rejection, the decoupled PPO loss, the mismatch metrics, and off = today's behaviour; then
the plain Learner: the on-policy step's log-probs come back for the metrics and the IS weights weigh its loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rayrl.algos import policy_loss, rollout_correction
from rayrl.batching import rollout_correction as correct_shards
from rayrl.config import ROLLOUT_RS_OPTIONS, AlgoConfig, RolloutCorrectionConfig, load_config
from rayrl.types import TrainBatch

L3, L05 = math.log(3.0), math.log(0.5)


def _lr(*ratios: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(proximal, behaviour) log-probs of one row whose proximal / behaviour ratios are `ratios`."""
    behaviour = torch.full((1, len(ratios)), -1.0)
    return behaviour + torch.tensor([ratios]).log(), behaviour


def test_verl_rejection_options_are_the_configs():
    from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS

    assert set(ROLLOUT_RS_OPTIONS) == SUPPORTED_ROLLOUT_RS_OPTIONS


def test_token_level_truncated_is_and_metrics():
    # ratios 3, 0.5, 1 -> weights min(r, 2) = 2, 0.5, 1; the mask is unchanged (no rejection)
    old, rollout = _lr(3.0, 0.5, 1.0)
    w, mask, m = rollout_correction(old, rollout, torch.ones(1, 3), RolloutCorrectionConfig(rollout_is="token"))
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert mask.tolist() == [[1.0, 1.0, 1.0]]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(3.5 / 3, abs=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # r=3 above the cap 2
    # log-ratio old - rollout = (log 3, log 0.5, 0): mean 0.135155, max |.| = log 3
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx((L3 + L05) / 3, abs=1e-6)
    assert m["rollout_corr/log_ratio_max"] == pytest.approx(L3, abs=1e-6)
    assert m["rollout_corr/kl"] == pytest.approx(-(L3 + L05) / 3, abs=1e-6)  # E[rollout - old]
    # k3 = r - 1 - log r per token: (3 - 1 - log 3) + (0.5 - 1 - log 0.5) + 0, over 3 tokens = 0.364837
    assert m["rollout_corr/k3_kl"] == pytest.approx((2 - L3 - 0.5 - L05) / 3, abs=1e-6)
    assert m["rollout_corr/masked_fraction"] == 0.0


def test_sequence_level_truncated_is():
    # row 0: ratios 1.2 x 1.5 = 1.8 <= 2 -> 1.8 on both tokens; row 1: 2 x 3 = 6 -> capped at 2; masked token -> 0
    old0, rb0 = _lr(1.2, 1.5, 1.0)
    old1, rb1 = _lr(2.0, 3.0, 50.0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w, _, m = rollout_correction(torch.cat([old0, old1]), torch.cat([rb0, rb1]), mask,
                                 RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0))
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8, 0.0], [2.0, 2.0, 0.0]]))
    assert m["rollout_corr/log_ratio_max"] == pytest.approx(math.log(3.0), abs=1e-6)  # the masked 50 is ignored


def test_token_rejection_k1_masks_tokens_beyond_the_ratio_bounds():
    # k1 bounds the engine / learner ratio 1/r to [0.5, 4], i.e. r in [0.25, 2]: r=3 leaves the loss, 0.3 and 1 stay
    old, rollout = _lr(3.0, 0.3, 1.0)
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=4.0, rollout_rs_threshold_lower=0.5)
    w, mask, m = rollout_correction(old, rollout, torch.ones(1, 3), cfg)
    assert w is None and mask.tolist() == [[0.0, 1.0, 1.0]]
    assert m["rollout_corr/masked_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


def test_sequence_rejection_masks_the_whole_sequence():
    # seq_sum_k1 with upper 2 (lower 1/2): row 0's product 1.2 x 1.5 = 1.8 stays; row 1's 2 x 3 = 6 is rejected
    old0, rb0 = _lr(1.2, 1.5)
    old1, rb1 = _lr(2.0, 3.0)
    cfg = RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0)
    _, mask, m = rollout_correction(torch.cat([old0, old1]), torch.cat([rb0, rb1]), torch.ones(2, 2), cfg)
    assert mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert m["rollout_corr/masked_fraction"] == pytest.approx(0.5)


def test_decoupled_ppo_loss_by_hand():
    """AReaL's decoupled objective: PPO-clip on current / proximal, times the truncated proximal / behaviour weight.
    Tokens (r = current / proximal, A, w): (1.1, +1, 2) -> -1.1 x 2; (1.5, +1, 0.5) -> clipped -1.28 x 0.5;
    (0.5, -1, 1) -> clipped 0.8 x 1. Token-mean: (-2.2 - 0.64 + 0.8) / 3 = -0.68."""
    prox = torch.full((1, 3), -1.0)
    current = prox + torch.tensor([[1.1, 1.5, 0.5]]).log()
    w = torch.tensor([[2.0, 0.5, 1.0]])
    cfg = AlgoConfig()
    loss, _ = policy_loss(prox, current, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3), cfg,
                          rollout_is_weights=w)
    assert loss.item() == pytest.approx(-0.68, abs=1e-5)
    plain, _ = policy_loss(prox, current, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3), cfg)
    assert plain.item() == pytest.approx((-1.1 - 1.28 + 0.8) / 3, abs=1e-5)


def _shards() -> tuple[list[TrainBatch], list[list[list[float]]]]:
    """Two ranks' shards of one mini-batch (rank 1's second row is padding) and the learner's log-probs of them."""
    b0 = TrainBatch(prompt_ids=[[1], [2]], response_ids=[[5, 6], [7, 8, 9]], loss_mask=[[1, 1], [1, 0, 1]],
                    advantages=[[1.0] * 2, [-1.0] * 3], global_tokens=5, global_seqs=3,
                    rollout_logprobs=[[-1.0, -1.0], [-1.0, 0.0, -1.0]])
    b1 = TrainBatch(prompt_ids=[[3], [3]], response_ids=[[4], [4]], loss_mask=[[1], [0]],
                    advantages=[[1.0], [0.0]], global_tokens=5, global_seqs=3, rollout_logprobs=[[-2.0], [0.0]])
    olds = [[[-1.0 + L3, -1.0], [-1.0 + L05, -7.0, -1.0]], [[-2.0], [-9.0]]]
    return [b0, b1], olds


def test_off_by_default_leaves_the_batch_as_it_was_and_reports_the_mismatch():
    cfg = load_config(None, [], check_files=False)
    assert not cfg.algo.rollout_correction.enabled and cfg.algo.rollout_correction.rollout_is is None
    shards, olds = _shards()
    before = copy.deepcopy(shards)
    m = correct_shards([shards], [olds], cfg.algo.rollout_correction)
    assert shards == before  # no weights, same masks, same global counts: the loss is today's
    # trained tokens only (the masked 0 and the padding row ignored): log-ratios log 3, 0, log 0.5, 0, 0
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx((L3 + L05) / 5, abs=1e-6)
    assert m["rollout_corr/log_ratio_max"] == pytest.approx(L3, abs=1e-6)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 1 + 0.5 + 1 + 1) / 5, abs=1e-6)  # monitored only


def test_shards_get_weights_and_rejection_with_recounted_totals():
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=2.5)
    shards, olds = _shards()
    correct_shards([shards], [olds], cfg)
    b0, b1 = shards
    # r = 3 is outside [1/2.5, 2.5]: rejected (its weight min(3, 2) no longer counts); the rest stay, weighted
    # min(r, 2); untrained tokens and the padding row weigh 0
    assert b0.loss_mask == [[0, 1], [1, 0, 1]] and b1.loss_mask == [[1], [0]]
    assert [w for row in b0.is_weights for w in row] == pytest.approx([2.0, 1.0, 0.5, 0.0, 1.0])
    assert b1.is_weights == [[1.0], [0.0]]
    assert b0.global_tokens == b1.global_tokens == 4 and b0.global_seqs == b1.global_seqs == 3


# --- the plain Learner (world size 1, gloo) ----------------------------------------------------------------------


@pytest.fixture
def learner(tiny_model, request):
    """A Learner at lr 1e-2, with the overrides a test passes by indirect parametrization."""
    from rayrl.learner import Learner

    ln = Learner(tiny_model, load_config(None, ["learner.lr=1e-2", *getattr(request, "param", [])],
                                         check_files=False))
    ln.setup()
    yield ln
    ln.shutdown()


def _shifted(logprobs: list[list[float]], shift: list[list[float]]) -> list[list[float]]:
    """Engine log-probs `shift` below the learner's, token by token (current / engine ratio exp(shift))."""
    return [[lp - d for lp, d in zip(row, ds, strict=True)] for row, ds in zip(logprobs, shift, strict=True)]


def _batch(**extra) -> TrainBatch:
    return TrainBatch(prompt_ids=[[1, 2, 3, 4], [5, 6, 7]], response_ids=[[8, 9, 10], [11, 12]],
                      loss_mask=[[1, 1, 1], [1, 0]], advantages=[[1.0] * 3, [-1.0] * 2], global_tokens=4,
                      global_seqs=2, **extra)


def test_learner_on_policy_step_returns_its_logprobs_for_the_mismatch_metrics(learner):
    batch = _batch()
    want = learner.compute_logprobs(batch)
    # the engine's log-probs 0.1 below the learner's on every trained token (0.0 where the mask is 0)
    batch.rollout_logprobs = [[lp - 0.1 if m else 0.0 for lp, m in zip(row, mask, strict=True)]
                              for row, mask in zip(want, batch.loss_mask, strict=True)]
    stats = learner.train_step(batch)
    assert stats.loss == pytest.approx(-0.5, abs=1e-6)  # no correction: today's on-policy loss
    assert [len(r) for r in stats.logprobs] == [3, 2]
    assert stats.logprobs == [pytest.approx(r, abs=1e-5) for r in want]
    m = correct_shards([[batch]], [[stats.logprobs]], RolloutCorrectionConfig())
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx(0.1, abs=1e-5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(math.exp(0.1) - 1.1, abs=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(0.1), abs=1e-5)
    assert m["rollout_corr/masked_fraction"] == 0.0
    assert learner.train_step(batch, old_logprobs=want).logprobs is None  # old log-probs given: nothing to return


def test_learner_applies_the_is_weights(learner):
    # on-policy ratio 1: token-mean of -A x w over the 4 trained tokens = -(0.5 + 0.5 + 0.5 - 0.5) / 4 = -0.25
    stats = learner.train_step(_batch(is_weights=[[0.5] * 3, [0.5, 0.0]]))
    assert stats.loss == pytest.approx(-0.25, abs=1e-6)


@pytest.mark.parametrize("learner", [["algo.rollout_correction.rollout_is=token"]], indirect=True)
def test_one_update_computes_the_is_weights_in_the_loss(learner):
    """One update with rollout_is (no proximal forward: the driver passes no old log-probs): train_step weighs each
    token by min(current / engine, threshold) of its own forward pass, the weights the driver's path would set."""
    batch = _batch()
    want = learner.compute_logprobs(batch)
    # engine / learner ratios 1/3, 1, 2 on the first row (weights min(3, 2), 1, 0.5), 1 on the second's token
    batch.rollout_logprobs = _shifted(want, [[math.log(3), 0.0, -math.log(2)], [0.0, 0.0]])
    expected = _batch(rollout_logprobs=batch.rollout_logprobs)
    correct_shards([[expected]], [[want]], RolloutCorrectionConfig(rollout_is="token"))
    assert [w for row in expected.is_weights for w in row] == pytest.approx([2.0, 1.0, 0.5, 1.0, 0.0], abs=1e-5)
    stats = learner.train_step(batch)
    assert batch.is_weights is None  # nothing set by a driver
    # token-mean of -A x w over the 4 trained tokens: -(2 + 1 + 0.5 - 1) / 4
    assert stats.loss == pytest.approx(-0.625, abs=1e-5)


@pytest.mark.parametrize("learner", [["algo.rollout_correction.bypass_mode=true"]], indirect=True)
def test_bypass_mode_clips_against_the_engines_logprobs(learner):
    """bypass_mode (verl's): one update, no proximal forward, and PPO's ratio is current / engine, so its clip binds
    on tokens the policy moved away from since the engine sampled them; the learner's own log-probs still come back
    for the mismatch metrics."""
    batch = _batch()
    want = learner.compute_logprobs(batch)
    # current / engine ratios 3, 1, 0.5 on the first row (advantage +1), 1 on the second's trained token (-1)
    batch.rollout_logprobs = _shifted(want, [[math.log(3), 0.0, math.log(0.5)], [0.0, 0.0]])
    stats = learner.train_step(batch)
    # verl's PPO-clip per token, max(-A r, -A clip(r, 0.8, 1.28)): -1.28 (clipped), -1, -0.5, +1; token-mean
    assert stats.loss == pytest.approx((-1.28 - 1.0 - 0.5 + 1.0) / 4, abs=1e-5)
    assert stats.pg_clipfrac == pytest.approx(0.25, abs=1e-6)  # the ratio-3 token
    assert stats.logprobs == [pytest.approx(r, abs=1e-5) for r in want]
