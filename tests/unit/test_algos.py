"""rayrl.algos against numbers worked out by hand (not by calling verl again)."""

from __future__ import annotations

import math

import pytest
import torch

from rayrl.algos import grpo_advantages, policy_loss
from rayrl.config import AlgoConfig

# --- GRPO advantages ---------------------------------------------------------------------------


def test_grpo_advantages_match_hand_computation() -> None:
    # group "a": rewards [1, 0, 0, 1] -> mean 0.5; deviations +-0.5;
    # unbiased var = 4 * 0.25 / (4 - 1) = 1/3; std = 0.57735...; adv = +-0.5 / 0.57735 = +-0.866025...
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = grpo_advantages(rewards, ["a"] * 4, mask, norm_by_std=True)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a == pytest.approx(0.8660239, abs=1e-6)
    expected = torch.tensor([[a, a, a], [-a, -a, 0.0], [-a, 0.0, 0.0], [a, a, a]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_grpo_advantages_without_std_are_centred_rewards() -> None:
    # Dr. GRPO: r - mean, mean = (3 + 1) / 2 = 2 -> [+1, -1]
    adv = grpo_advantages(torch.tensor([3.0, 1.0]), ["g", "g"], torch.ones(2, 2), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))


def test_grpo_groups_are_independent_and_identical_rewards_give_zero() -> None:
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0])
    groups = ["same", "same", "same", "other", "other"]
    adv = grpo_advantages(rewards, groups, torch.ones(5, 2))
    assert torch.all(adv[:3] == 0.0)
    # "other": mean 0.5, unbiased std = sqrt(2 * 0.25 / 1) = 0.70711; adv = +-0.5 / 0.70711 = +-0.70711
    torch.testing.assert_close(adv[3:, 0], torch.tensor([0.7071058, -0.7071058]), rtol=0, atol=1e-6)


def test_grpo_singleton_group_keeps_raw_reward() -> None:
    # verl's convention (mean 0, std 1 for a group of one); the driver must drop incomplete groups.
    adv = grpo_advantages(torch.tensor([0.25]), ["alone"], torch.ones(1, 2))
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.25]]), rtol=0, atol=1e-5)


# --- policy loss -------------------------------------------------------------------------------

# clip_ratio_low 0.2 -> ratios below 0.8 clip; clip_ratio_high 0.28 -> above 1.28 clip; dual clip c = 3.
CFG = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")

# Per token: (ratio, advantage) -> loss by hand, loss = max(-A r, -A clip(r)), then min(., -A c) if A < 0.
#   r=1.1, A=+1: inside the clip range           -> -1.1   (gradient flows)
#   r=1.5, A=+1: clipped at 1.28                 -> -1.28  (pg_clipfrac)
#   r=0.5, A=-1: clipped at 0.8                  -> +0.8   (pg_clipfrac)
#   r=5.0, A=-1: max(5, 1.28) = 5, dual clip c=3 -> +3.0   (pg_clipfrac_lower)
#   r=0.5, A=+1: max(-0.5, -0.8), not clipped    -> -0.5   (gradient flows)
CASES = [(1.1, 1.0, -1.1), (1.5, 1.0, -1.28), (0.5, -1.0, 0.8), (5.0, -1.0, 3.0), (0.5, 1.0, -0.5)]


def _tokens(cases: list[tuple[float, float, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio = torch.tensor([[r for r, _, _ in cases]])
    adv = torch.tensor([[a for _, a, _ in cases]])
    old = torch.full_like(ratio, -1.0)
    return old, old + ratio.log(), adv


@pytest.mark.parametrize("ratio,adv,expected", CASES)
def test_policy_loss_single_token(ratio: float, adv: float, expected: float) -> None:
    old, new, a = _tokens([(ratio, adv, expected)])
    loss, _ = policy_loss(old, new, a, torch.ones(1, 1), CFG)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_policy_loss_metrics_over_four_tokens() -> None:
    old, new, adv = _tokens(CASES[:4])
    loss, m = policy_loss(old, new, adv, torch.ones(1, 4), CFG)
    assert loss.item() == pytest.approx((-1.1 - 1.28 + 0.8 + 3.0) / 4, abs=1e-5)  # 0.355
    assert m["pg_loss"] == pytest.approx(0.355, abs=1e-5)
    assert m["pg_clipfrac"] == pytest.approx(2 / 4)  # r=1.5 and r=0.5
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 4)  # r=5 hit the dual clip
    # ppo_kl = mean(old - new) = -mean(log r) = -log(1.1 * 1.5 * 0.5 * 5) / 4
    assert m["ppo_kl"] == pytest.approx(-math.log(4.125) / 4, abs=1e-5)


def _masked_batch() -> tuple[torch.Tensor, ...]:
    # row 0: tokens 1, 2, 5 of CASES; row 1: tokens 3, 4 and one masked token with absurd values.
    old0, new0, adv0 = _tokens([CASES[0], CASES[1], CASES[4]])
    old1, new1, adv1 = _tokens([CASES[2], CASES[3], (50.0, 100.0, 0.0)])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return torch.cat([old0, old1]), torch.cat([new0, new1]), torch.cat([adv0, adv1]), mask


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (-1.1 - 1.28 - 0.5 + 0.8 + 3.0) / 5),  # 0.92 / 5 = 0.184
    ("seq-mean-token-mean", ((-1.1 - 1.28 - 0.5) / 3 + (0.8 + 3.0) / 2) / 2),  # (-0.96 + 1.9) / 2 = 0.47
    ("seq-mean-token-sum", ((-1.1 - 1.28 - 0.5) + (0.8 + 3.0)) / 2),  # 0.46
])
def test_policy_loss_aggregation_ignores_masked_tokens(mode: str, expected: float) -> None:
    old, new, adv, mask = _masked_batch()
    cfg = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    loss, _ = policy_loss(old, new, adv, mask, cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_policy_loss_gradient_only_through_unclipped_tokens() -> None:
    old, new, adv, mask = _masked_batch()
    new.requires_grad_(True)
    loss, _ = policy_loss(old, new, adv, mask, CFG)
    loss.backward()
    # d(-A r)/d logp = -A r; token-mean over 5 tokens: r=1.1,A=1 -> -0.22; r=0.5,A=1 -> -0.1; clipped -> 0
    expected = torch.tensor([[-0.22, 0.0, -0.1], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(new.grad, expected, rtol=0, atol=1e-6)


def test_kl_and_entropy_terms() -> None:
    # zero advantages -> pg term is 0. new - ref = log 2; low_var_kl (k3) = e^(ref-new) - (ref-new) - 1
    # = 0.5 + log 2 - 1 = 0.193147; x coef 0.1 = 0.0193147. Entropy 2.0 x coeff 0.01 is subtracted.
    new = torch.zeros(2, 2)
    ref = new - math.log(2)
    cfg = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.01)
    loss, m = policy_loss(new, new, torch.zeros(2, 2), torch.ones(2, 2), cfg, ref_logprobs=ref,
                          entropy=torch.full((2, 2), 2.0))
    assert m["kl_loss"] == pytest.approx(math.log(2) - 0.5, abs=1e-6)
    assert m["entropy"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.1 * (math.log(2) - 0.5) - 0.01 * 2.0, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(new, new, torch.zeros(2, 2), torch.ones(2, 2), cfg)


# --- micro-batches -----------------------------------------------------------------------------


def _random_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 2
    new = old + (torch.rand(4, 6, generator=g) - 0.5)  # ratios in [0.61, 1.65]: some clip
    adv = torch.randn(4, 6, generator=g)
    lengths = torch.tensor([6, 1, 3, 5])  # unequal token counts: a per-micro-batch mean would be wrong
    mask = (torch.arange(6) < lengths[:, None]).float()
    return old, new, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_micro_batches_sum_to_full_batch_loss_and_gradient(mode: str, dp_size: int) -> None:
    old, new, adv, mask = _random_batch()
    cfg = AlgoConfig(loss_agg_mode=mode)
    full_new = new.clone().requires_grad_(True)
    full, _ = policy_loss(old, full_new, adv, mask, cfg)
    full.backward()

    # 4 sequences -> dp_size ranks -> micro-batches of one sequence each. Each rank sums its
    # micro-batch losses (gradient accumulation); the ranks' gradients are then averaged (FSDP).
    tokens, seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    split_new = new.clone().requires_grad_(True)
    per_rank = 4 // dp_size
    rank_losses = []
    for rank in range(dp_size):
        total = torch.zeros(())
        for i in range(rank * per_rank, (rank + 1) * per_rank):
            s = slice(i, i + 1)
            loss, _ = policy_loss(old[s], split_new[s], adv[s], mask[s], cfg,
                                  global_token_count=tokens, global_seq_count=seqs, dp_size=dp_size)
            total = total + loss
        rank_losses.append(total)
    (sum(rank_losses) / dp_size).backward()  # = the all-reduce mean of the ranks' gradients

    torch.testing.assert_close(sum(rank_losses) / dp_size, full.detach())
    torch.testing.assert_close(split_new.grad, full_new.grad)


def test_micro_batches_without_global_count_are_not_the_token_mean() -> None:
    # Why global_token_count exists: averaging per micro-batch weighs a 1-token sequence like a 6-token one.
    old, new, adv, mask = _random_batch()
    full, _ = policy_loss(old, new, adv, mask, CFG)
    naive = sum(policy_loss(old[i:i + 1], new[i:i + 1], adv[i:i + 1], mask[i:i + 1], CFG)[0] for i in range(4)) / 4
    assert abs(naive.item() - full.item()) > 1e-3
