"""Activation checkpointing of the learner's decoder layers (`model.gradient_checkpointing`).

Each layer keeps only its input for backward and runs its forward again there. With
`model.gradient_checkpointing_keep_attention` it also keeps the attention kernel's outputs (the attention output and
its log-sum-exp; torch's selective activation checkpointing), so backward recomputes the layer's projections, norms
and MLP but not the attention itself. At the seed lengths (16k-token sequences) the causal attention forward is about
40% of a Qwen3-4B layer's forward FLOPs, and its output is one [tokens x heads x head_dim] bf16 tensor per layer
(Megatron-LM's "selective recompute" keeps the layer and recomputes the attention core; here the trade goes the
other way because long-sequence attention is the expensive, small-output part).

The checkpoint wraps each layer's forward before torch.compile does (torchtitan's order), so a compiled layer's
recomputation is part of its compiled backward: the partitioner honours the kept outputs, and the recompute cannot
pick a different compiled graph than the forward did (varying micro-batch sizes recompile the layer once).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# The attention kernels whose outputs are kept: torch's varlen flash op (rayrl.attention on GPU), the fused sdpa
# kernels, and the CPU flash kernel rayrl.attention's reference path runs on.
ATTENTION_OPS = frozenset({
    "torch_attn._varlen_attn", "aten._flash_attention_forward", "aten._efficient_attention_forward",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu"})


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    name = str(getattr(op, "overloadpacket", op))
    return CheckpointPolicy.MUST_SAVE if name in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_context():
    return create_selective_checkpoint_contexts(_keep_attention)


def checkpointed(forward, keep_attention: bool = False):
    """`forward` run under a non-reentrant activation checkpoint (keeping the attention kernels' outputs if asked)."""
    kwargs = {"context_fn": _keep_attention_context} if keep_attention else {}
    return functools.partial(checkpoint, forward, use_reentrant=False, **kwargs)


def wrap_layers(layers, checkpoint_layers: bool, keep_attention: bool, compiled: bool,
                dynamic: bool | None = None) -> None:
    """Give each decoder layer its forward: checkpointed (if asked), then compiled (if asked)."""
    for layer in layers:
        forward = layer.forward
        if checkpoint_layers:
            forward = checkpointed(forward, keep_attention)
        if compiled:
            forward = torch.compile(forward, dynamic=dynamic)
        layer.forward = forward
