"""From a step's trajectories to learner batches: group, drop what cannot be trained on, advantages, shards.

How failures are treated (documented in the README):
- a failed trajectory (agent or reward raised / timed out, or no tokens) is never trained on;
- a group's baseline is computed over its successful members only;
- a group with fewer than 2 successful members is dropped (no baseline); it is counted in the step log.
"""

from __future__ import annotations

from collections import defaultdict

import torch

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


def advantages(groups: list[list[Trajectory]], norm_by_std: bool) -> list[list[float]]:
    """Per-token GRPO advantages (verl's estimator), in the order of the flattened groups."""
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
    return [[a] * len(t.response_ids) for a, t in zip(per_seq, flat)]


def shard(groups: list[list[Trajectory]], advs: list[list[float]], world: int) -> list[TrainBatch]:
    """Split a mini-batch over `world` ranks with equal sequence counts (FSDP ranks must run the same number of
    forward passes), longest-first round robin for balanced tokens; padding rows are fully masked copies."""
    flat = [t for g in groups for t in g]
    order = sorted(range(len(flat)), key=lambda i: -len(flat[i].response_ids))
    tokens = sum(sum(t.loss_mask) for t in flat)
    per_rank = -(-len(flat) // world) if flat else 0
    out = []
    for r in range(world):
        idx = order[r::world]
        b = TrainBatch(prompt_ids=[flat[i].prompt_ids for i in idx], response_ids=[flat[i].response_ids for i in idx],
                       loss_mask=[flat[i].loss_mask for i in idx], advantages=[advs[i] for i in idx],
                       global_tokens=tokens, global_seqs=len(flat))
        while len(b) < per_rank:  # pad with a masked copy of a real row
            j = order[-1]
            b.prompt_ids.append(flat[j].prompt_ids)
            b.response_ids.append(flat[j].response_ids)
            b.loss_mask.append([0] * len(flat[j].loss_mask))
            b.advantages.append([0.0] * len(flat[j].loss_mask))
        out.append(b)
    return out
