"""From a step's trajectories to learner batches: group, drop what cannot be trained on, advantages, shards, and
the learner's token-budget micro-batches.

How failures are treated (documented in the README):
- a failed trajectory (agent or reward raised / timed out, or no tokens) is never trained on; an over-long one
  (its token budget ran out) is not a failure: it is trained truncated at rollout.max_response_length, as verl does;
- a group's baseline is computed over its successful members only;
- a group with fewer than 2 successful members is dropped (no baseline); it is counted in the step log.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from rayrl.config import RolloutCorrectionConfig
from rayrl.types import TrainBatch, Trajectory


def trainable_groups(trajs: list[Trajectory]) -> tuple[list[list[Trajectory]], int]:
    """Successful trajectories grouped by prompt, groups with < 2 successes dropped. Returns (groups, dropped)."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.group_id]  # keep groups whose members all failed, to count them
        if t.ok:
            groups[t.group_id].append(t)
    keep = [sorted(g, key=lambda t: t.task_id) for _, g in sorted(groups.items()) if len(g) >= 2]
    return keep, len(groups) - len(keep)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread for the driver's tensor math ([rows x response tokens]; most of its time is building the
    tensors from lists). The driver shares its node with the rollout workers and engines, which are busy during an
    async step's update: on one H200 host (16 cores) the driver's time between that update and the weight sync,
    rollout_correction's metrics mostly, was 0.3-0.76 s in async steps against 0.02 s in synchronous ones
    (bench/gpu/results/2026-12-05), the pattern of intra-op threads spinning against busy cores. On 2 cores beside
    2 busy processes, a step's rollout_correction took 24-111 ms on 2 threads and 26-32 ms on one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@_one_thread()
def advantages(groups: list[list[Trajectory]], norm_by_std: bool) -> list[list[float]]:
    """Per-token GRPO advantages (verl's estimator), in the order of the flattened groups."""
    import torch

    from rayrl.algos import grpo_advantages  # imports verl (~7 s): only where it is used

    flat = [t for g in groups for t in g]
    if not flat:
        return []
    width = max(len(t.response_ids) for t in flat)
    mask = torch.zeros(len(flat), width)
    for i, t in enumerate(flat):
        mask[i, : len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    rewards = torch.tensor([t.reward for t in flat], dtype=torch.float32)
    adv = grpo_advantages(rewards, [t.group_id for t in flat], mask, norm_by_std=norm_by_std)
    # GRPO's advantage is one number per sequence: broadcast it over every token, masked ones included
    # (the loss mask removes those), so env tokens inside the response need no special casing.
    per_seq = [float(adv[i][mask[i] > 0][0]) if mask[i].any() else 0.0 for i in range(len(flat))]
    return [[a] * len(t.response_ids) for a, t in zip(per_seq, flat, strict=True)]


def shard(groups: list[list[Trajectory]], advs: list[list[float]], world: int,
          sequence_parallel: int = 1) -> list[TrainBatch]:
    """Split a mini-batch over `world` ranks with equal sequence counts (FSDP ranks must run the same number of
    forward passes), longest-first round robin for balanced tokens; padding rows are fully masked copies. With
    `sequence_parallel` k, ranks form world/k groups of k consecutive ranks, and each rank of a group gets its
    group's shard (learner.sequence_parallel: the group splits every row between them)."""
    if sequence_parallel > 1:
        return [b for b in shard(groups, advs, world // sequence_parallel) for _ in range(sequence_parallel)]
    flat = [t for g in groups for t in g]
    order = sorted(range(len(flat)), key=lambda i: -len(flat[i].response_ids))
    tokens = sum(sum(t.loss_mask) for t in flat)
    per_rank = -(-len(flat) // world) if flat else 0
    out = []
    for r in range(world):
        idx = order[r::world]
        b = TrainBatch(prompt_ids=[flat[i].prompt_ids for i in idx], response_ids=[flat[i].response_ids for i in idx],
                       loss_mask=[flat[i].loss_mask for i in idx], advantages=[advs[i] for i in idx],
                       global_tokens=tokens, global_seqs=len(flat),
                       rollout_logprobs=[_engine_lps(flat[i]) for i in idx])
        while len(b) < per_rank:  # pad with a masked copy of a real row
            j = order[-1]
            b.prompt_ids.append(flat[j].prompt_ids)
            b.response_ids.append(flat[j].response_ids)
            b.loss_mask.append([0] * len(flat[j].loss_mask))
            b.advantages.append([0.0] * len(flat[j].loss_mask))
            b.rollout_logprobs.append([0.0] * len(flat[j].loss_mask))
        out.append(b)
    return out


def _engine_lps(t) -> list[float]:
    """A trajectory's engine log-probs; zeros for an SFT example, which has none."""
    return getattr(t, "logprobs", None) or [0.0] * len(t.loss_mask)


@_one_thread()
def rollout_correction(minibatches: list[list[TrainBatch]], olds: list[list[list[list[float]]]],
                       cfg: RolloutCorrectionConfig, sequence_parallel: int = 1) -> dict[str, float]:
    """Each mini-batch's shards (one per rank, as `shard` made them) and the learner's log-probs of their rows before
    the update (per rank, per row) -> the step's rollout_corr/ metrics against the engines' log-probs
    (rayrl.algos.rollout_correction, over every trained token of the step). With `cfg.enabled`, the shards are
    changed in place: `is_weights` set (rollout_is), rejected tokens out of `loss_mask` and the mini-batch's global
    counts recounted (rollout_rs), as verl applies them to the whole batch before the update."""
    import torch

    from rayrl.algos import rollout_correction as correct  # imports verl: only where it is used

    # (mini-batch, shard, row) of every row with a trained token; ranks of a sequence-parallel group share a shard
    rows = [(m, b, j, old[j]) for m, (shards, rank_olds) in enumerate(zip(minibatches, olds, strict=True))
            for b, old in zip(shards[::sequence_parallel], rank_olds[::sequence_parallel], strict=True)
            for j in range(len(b)) if any(b.loss_mask[j])]
    if not rows:
        return {}
    width = max(len(b.response_ids[j]) for _, b, j, _ in rows)

    def padded(values) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.float32)
        for n, v in enumerate(values):
            out[n, : len(v)] = torch.tensor(v, dtype=torch.float32)
        return out

    weights, mask, metrics = correct(padded(old for *_, old in rows),
                                     padded(b.rollout_logprobs[j] for _, b, j, _ in rows),
                                     padded(b.loss_mask[j] for _, b, j, _ in rows), cfg)
    if not cfg.enabled:
        return metrics
    for n, (_, b, j, _) in enumerate(rows):
        length = len(b.response_ids[j])
        if weights is not None:
            if b.is_weights is None:  # rows without a trained token keep weight 0
                b.is_weights = [[0.0] * len(r) for r in b.response_ids]
            b.is_weights[j] = weights[n, :length].tolist()
        b.loss_mask[j] = [int(x) for x in mask[n, :length].tolist()]
    if cfg.rollout_rs is None:
        return metrics
    for shards in minibatches:  # rejection removed tokens (and maybe whole sequences): recount what the loss divides by
        unique = shards[::sequence_parallel]
        tokens = sum(sum(m) for b in unique for m in b.loss_mask)
        seqs = sum(1 for b in unique for m in b.loss_mask if any(m))
        for b in shards:
            b.global_tokens, b.global_seqs = tokens, seqs
    return metrics


def token_budget_bins(lengths: list[int], budget: int, min_bins: int = 0) -> list[list[int]]:
    """Indices of `lengths` grouped so that each group's total is <= `budget` (a longer sequence gets a group of
    its own), first-fit decreasing; then the fullest groups are halved until there are `min_bins` of them (at
    most one per sequence). Indices ascend within a group. The learner's micro-batches (one packed row each)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, load in enumerate(loads) if load + lengths[i] <= budget), len(bins))
        if k == len(bins):
            bins.append([])
            loads.append(0)
        bins[k].append(i)
        loads[k] += lengths[i]
    while len(bins) < min(min_bins, len(lengths)):
        k = max((k for k in range(len(bins)) if len(bins[k]) > 1), key=lambda k: loads[k])
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(bins.pop(k), key=lambda i: -lengths[i]):  # longest first, each to the lighter half
            min(halves, key=lambda h: sum(lengths[j] for j in h)).append(i)
        loads.pop(k)
        bins += halves
        loads += [sum(lengths[j] for j in h) for h in halves]
    return [sorted(b) for b in bins]
