"""DeepSpeed-Ulysses sequence parallelism for the learner's packed rows (`learner.sequence_parallel: k`), as verl does
it (verl.utils.ulysses; the seed's `ulysses_sequence_parallel_size`).

The learner ranks form world/k data-parallel groups of k consecutive ranks; every rank of a group gets the same
shard. Each holds 1/k of the packed row (tokens and positions; the row padded at its end to a multiple of k) through
the embeddings, MLPs, norms and the fused lm_head. In each attention layer an all-to-all trades sequence for heads:
every rank sees the whole row for h/k query heads (kv heads repeated up to k when there are fewer), attends with
the row's real sequence boundaries, and a second all-to-all trades back. The log-probs of the rank's response
positions are gathered over the group, so each rank computes the same loss over the whole shard; the gather's
backward keeps the rank's own slice of the gradient and multiplies it by k (verl's grad_scaler), which with the loss
normalised for world/k data-parallel groups gives FSDP's average over all world ranks exactly k=1's gradient.

verl's all-to-all, gather and padding run as they are (gloo has all_to_all on CPU: the tests run there). Ours are the
slicing (verl's slice_input_tensor reads the rank from verl's module-global group; here the group is passed
explicitly) and the attention wrapper (verl's wraps the flash-attn package's `_flash_attention_forward` and its
[B, T, H, D] layout; ours wraps rayrl.attention's varlen attention, [B, H, T, D]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from verl.utils.ulysses import gather_heads_scatter_seq, gather_outputs_and_unpad, gather_seq_scatter_heads, ulysses_pad


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: `size` ranks, this one `rank` of them."""

    group: Any  # torch.distributed ProcessGroup of the k ranks
    size: int
    rank: int

    @staticmethod
    def create(k: int, device_type: str) -> SequenceParallel:
        """The ("dp", "sp") device mesh of the initialised process group: ranks dp*k .. dp*k+k-1 form one group."""
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world % k:
            raise ValueError(f"learner.num_workers ({world}) must be divisible by learner.sequence_parallel ({k})")
        mesh = init_device_mesh(device_type, (world // k, k), mesh_dim_names=("dp", "sp"))
        return SequenceParallel(group=mesh["sp"].get_group(), size=k, rank=mesh["sp"].get_local_rank())

    # --- inputs --------------------------------------------------------------------------------

    def split_row(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """[1, T] token ids and positions -> this rank's [1, ceil(T / k)] part of each, and the padded row's length
        (verl's ulysses_pad: the row padded at its end to a multiple of k, the padding a sequence of its own with
        positions 0, 1, ...; it attends to itself only, and nothing reads its outputs)."""
        ids, positions, _ = ulysses_pad(ids, positions, sp_size=self.size)
        part = ids.shape[1] // self.size
        local = slice(self.rank * part, (self.rank + 1) * part)
        return ids[:, local], positions[:, local], ids.shape[1]

    def keep_counts(self, keep: np.ndarray, length: int) -> np.ndarray:
        """How many of the row's (ascending) `keep` positions each rank's part holds."""
        part = -(-length // self.size)
        return np.bincount(keep // part, minlength=self.size)

    def local_keep(self, keep: np.ndarray, targets: torch.Tensor, length: int) -> tuple[np.ndarray, torch.Tensor]:
        """This rank's `keep` positions, relative to its part, and their `targets`. A part holding none (all prompt)
        keeps its first position, target 0, whose output `gather` drops (the fused lm_head takes no empty input)."""
        part, counts = -(-length // self.size), self.keep_counts(keep, length)
        if counts[self.rank] == 0:
            return np.zeros(1, dtype=keep.dtype), targets.new_zeros(1)
        start = int(counts[: self.rank].sum())
        mine = slice(start, start + int(counts[self.rank]))
        return keep[mine] - self.rank * part, targets[mine]

    # --- outputs -------------------------------------------------------------------------------

    def gather(self, local: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
        """Each rank's first counts[r] rows of `local` -> all of them in rank order, on every rank. verl's gather
        needs equal parts: each is padded to the largest; its backward scales this rank's gradient by k (module doc)."""
        most = max(int(counts.max()), 1)  # a rank with no rows sends its placeholder row (`local_keep`)
        padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, most - local.shape[0]))
        full = gather_outputs_and_unpad(padded, gather_dim=0, grad_scaler=True, group=self.group)
        rows = np.concatenate([r * most + np.arange(c) for r, c in enumerate(counts)])
        return full[torch.from_numpy(rows).to(full.device)]

    # --- attention -----------------------------------------------------------------------------

    @torch.compiler.disable  # collectives inside: a graph break in a compiled decoder layer, not a traced all-to-all
    def attention(self, inner, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        """transformers' attention call on this rank's part of the row: query [1, Hq, T/k, D], key/value
        [1, Hkv, T/k, D] -> `inner` on the whole row for Hq/k heads (its boundaries `cu_seq_lens_q` are the whole
        padded row's, the padding its last sequence) -> ([1, T/k, Hq, D], None)."""
        if key.shape[1] < self.size:  # too few kv heads to split: each serves its query heads on k / Hkv ranks
            rep = self.size // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        q, k, v = (gather_seq_scatter_heads(t, seq_dim=2, head_dim=1, group=self.group)  # -> [1, H/k, T, D]
                   for t in (query, key, value))
        out, _ = inner(module, q, k, v, attention_mask, scaling, dropout, **kw)  # [1, T, H/k, D]
        return gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=self.group), None  # -> [1, T/k, H, D]
