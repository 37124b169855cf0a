"""GRPO advantages, the PPO-clip policy loss and the rollout (off-policy) correction, delegated to verl's
`trainer/ppo/core_algos` and `trainer/ppo/rollout_corr_helper`.

The math is verl's; these wrappers only translate our tensors and `AlgoConfig` into the
arguments verl 0.9.1 wants, and its metric names into ours.

Micro-batching. A mini-batch (one optimizer step) is split over `dp_size` ranks and, on each
rank, into micro-batches whose losses are backpropagated one after another (gradients add up),
then FSDP averages the gradients over ranks. For the result to equal the loss of the whole
mini-batch, every micro-batch must be normalised by mini-batch-wide counts, not its own:
pass `global_token_count` (valid response tokens in the whole mini-batch, all ranks; for
token-mean), `global_seq_count` (sequences with at least one valid token, all ranks; for the
seq-mean modes) and `dp_size`. verl's `agg_loss` then returns
`masked_sum(micro) / global_count * dp_size`: summed over a rank's micro-batches and averaged
over ranks this is exactly the mini-batch mean. Left at None, each micro-batch is averaged on
its own (exact only when the micro-batch is the whole mini-batch).
"""

from __future__ import annotations

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from rayrl.config import AlgoConfig, RolloutCorrectionConfig


def grpo_advantages(rewards: torch.Tensor, group_ids: list[str], response_mask: torch.Tensor,
                    norm_by_std: bool = True, epsilon: float = 1e-6) -> torch.Tensor:
    """[B] scalar rewards -> [B, T] advantages, via `core_algos.compute_grpo_outcome_advantage`.

    Within each group: (r - mean) / (std + epsilon), std unbiased as `torch.std`; without
    `norm_by_std`, r - mean (Dr. GRPO). Masked tokens get 0. A group of one gets mean 0 and
    std 1 from verl, i.e. its raw reward: drop incomplete groups before calling this.
    """
    mask = response_mask.to(torch.float32)
    # verl sums token_level_rewards over the row, so the position only has to be inside it; we
    # use the last valid token, as verl's reward managers do.
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = (positions * (mask > 0)).amax(dim=1)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = rewards.to(mask)
    advantages, _returns = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards, response_mask=mask, index=np.array(group_ids, dtype=object),
        epsilon=epsilon, norm_adv_by_std_in_grpo=norm_by_std)
    return advantages


def policy_loss(old_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, cfg: AlgoConfig, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, *, global_token_count: int | None = None,
                global_seq_count: int | None = None, dp_size: int = 1,
                loss_scale_factor: int | None = None, rollout_is_weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss of one micro-batch ([B, T] tensors) and its metrics.

    pg: `core_algos.compute_policy_loss_vanilla` (clip_ratio_low/high, dual clip clip_ratio_c), each token's
    term times `rollout_is_weights` when given (the truncated IS weights of `rollout_correction`),
    aggregated by `core_algos.agg_loss` in `cfg.loss_agg_mode`; + `cfg.kl_loss_coef` x
    `core_algos.kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type)` when `cfg.use_kl_loss`;
    - `cfg.entropy_coeff` x entropy when `entropy` (per-token, [B, T]) is given.
    See the module docstring for `global_token_count` / `global_seq_count` / `dp_size`;
    `loss_scale_factor` is the constant divisor of seq-mean-token-sum-norm (default: T of this
    micro-batch, which changes with padding: pass rollout.max_response_length).
    Metrics: pg_loss, kl_loss and entropy are this micro-batch's share of the mini-batch value
    when global counts are given (sum them over micro-batches, average over ranks);
    pg_clipfrac, pg_clipfrac_lower and ppo_kl are means over this micro-batch's tokens.
    """
    mask = response_mask.to(torch.float32)
    batch_info = {"dp_size": dp_size, "batch_num_tokens": global_token_count,
                  "global_batch_size": global_seq_count, "loss_scale_factor": loss_scale_factor}
    # verl reads clip_ratio{,_low,_high}, clip_ratio_c and global_batch_info from an ActorConfig;
    # strategy, rollout_n and the micro-batch size are required by its __post_init__ but unused here.
    actor_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                            clip_ratio=cfg.clip_ratio_low, clip_ratio_low=cfg.clip_ratio_low,
                            clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                            loss_agg_mode=cfg.loss_agg_mode, global_batch_info=batch_info)
    pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old_logprobs, log_prob=logprobs, advantages=advantages, response_mask=mask,
        loss_agg_mode=cfg.loss_agg_mode, config=actor_cfg, rollout_is_weights=rollout_is_weights)
    metrics = {"pg_loss": pg_loss.item(), "pg_clipfrac": pg_metrics["actor/pg_clipfrac"],
               "pg_clipfrac_lower": pg_metrics["actor/pg_clipfrac_lower"], "ppo_kl": pg_metrics["actor/ppo_kl"]}
    loss = pg_loss

    def agg(loss_mat: torch.Tensor) -> torch.Tensor:
        return core_algos.agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **batch_info)

    if cfg.use_kl_loss:
        if ref_logprobs is None:
            raise ValueError("algo.use_kl_loss is set but no ref_logprobs were given")
        kl_loss = agg(core_algos.kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.item()
    if entropy is not None:
        entropy_loss = agg(entropy)
        loss = loss - cfg.entropy_coeff * entropy_loss
        metrics["entropy"] = entropy_loss.item()
    return loss, metrics


def rollout_is_weights(proximal: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """The truncated IS weights of `rollout_correction` alone ([B, T]; verl's compute_rollout_correction_weights,
    cfg.rollout_is level), for a train_step whose proximal log-probs are its own forward pass (one update, no
    rejection): the same weights the driver would have set from a separate forward, computed in the loss."""
    from verl.trainer.ppo import rollout_corr_helper as rc

    mask = response_mask.to(torch.float32)
    if not mask.any():
        return torch.zeros_like(mask)
    weights, _ = rc.compute_rollout_correction_weights(log_ratio=proximal - rollout_logprobs, response_mask=mask,
                                                       rollout_is=cfg.rollout_is,
                                                       rollout_is_threshold=cfg.rollout_is_threshold)
    return weights


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The learner's (proximal) against the engines' (behaviour) log-probs of the sampled tokens ([B, T] tensors):
    (IS weights or None, response mask, metrics), by verl's `compute_rollout_correction_and_rejection_mask`.

    Weights: min(exp(old - rollout), cfg.rollout_is_threshold) per token, or per sequence from the summed log-ratio
    (cfg.rollout_is; None when off). Mask: `response_mask` without the tokens / sequences cfg.rollout_rs rejects.
    Metrics, all under rollout_corr/: verl's (kl, k3_kl, training_ppl, rollout_ppl, log_ppl_diff, chi2_token,
    chi2_seq, rollout_is_* and rollout_rs_* of what is on); with rollout_is off, the rollout_is_* of token-level
    weights at the threshold, as monitoring (not applied); and log_ratio_mean (old - rollout over the mask),
    log_ratio_max (its largest absolute value), masked_fraction (of the mask's tokens rejected; 0 with rs off).
    """
    from verl.trainer.ppo import rollout_corr_helper as rc

    mask = response_mask.to(torch.float32)
    if not mask.any():
        return None, mask, {}
    rs_threshold = None
    if cfg.rollout_rs is not None:  # verl's spec: "lower_upper" for the k1 (ratio) options, else the upper bound
        low = cfg.rollout_rs_threshold_lower
        rs_threshold = (f"{low if low is not None else 1 / cfg.rollout_rs_threshold}_{cfg.rollout_rs_threshold}"
                        if cfg.rollout_rs.endswith("k1") else cfg.rollout_rs_threshold)
    weights, new_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_logprobs, rollout_log_prob=rollout_logprobs, response_mask=mask,
        rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_rs=cfg.rollout_rs, rollout_rs_threshold=rs_threshold)
    log_ratio = (old_logprobs - rollout_logprobs) * mask
    if cfg.rollout_is is None:
        _, is_metrics = rc.compute_rollout_correction_weights(log_ratio, mask, "token", cfg.rollout_is_threshold)
        metrics.update({f"rollout_corr/{k}": v for k, v in is_metrics.items()})
    metrics["rollout_corr/log_ratio_mean"] = float(log_ratio.sum() / mask.sum())
    metrics["rollout_corr/log_ratio_max"] = float(log_ratio.abs().max())
    metrics["rollout_corr/masked_fraction"] = float(1 - new_mask.sum() / mask.sum())
    return None if weights is None else weights.batch["rollout_is_weights"], new_mask, metrics
