"""Padding-free attention for the learner's packed rows (`learner.pack`) on GPU.

A packed micro-batch is one row of several sequences, with `position_ids` restarting per sequence and their
boundaries (`cu_seq_lens_q`, `max_length_q`) passed to the model's forward. transformers' `sdpa` turns that into a
dense T x T block-diagonal mask, which rules out the flash kernel and made packing slower than padding on an H200.
`rayrl_varlen` instead hands the boundaries to PyTorch's own varlen flash attention
(`torch.nn.attention.varlen.varlen_attn`): no mask, no padding, each sequence attends causally to itself only.
On CPU (tests), and in fp32, the same function runs causal sdpa per sequence, so the plumbing is checked where the
kernel is not. Sequence parallelism (rayrl.ulysses) wraps it in its all-to-all, on GPU and CPU alike.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "rayrl_varlen"
GQA_IN_KERNEL = False  # set by register() on a GPU: the varlen kernel reads the shared kv heads itself


def register() -> str:
    """Make `attn_implementation="rayrl_varlen"` known to transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global GQA_IN_KERNEL
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, _no_mask)  # the kernel masks by the boundaries itself
    if torch.cuda.is_available():
        GQA_IN_KERNEL = kernel_takes_gqa()
    return NAME


def kernel_takes_gqa() -> bool:
    """Whether this torch's varlen flash kernel takes fewer kv heads than query heads. torch 2.13 says so with
    `enable_gqa`; 2.11's varlen_attn has no such flag, but the FlashAttention-2 kernel under it supports grouped
    kv heads. Checked once on the GPU, forward and backward, against repeated kv heads: False on any error or
    difference, and the caller repeats them (a copy of k and v per layer, and a sum in backward)."""
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        cu = torch.tensor([0, 40, 96], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(96, h, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
        results = []
        for native in (True, False):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            kv = (kk, vv) if native else (kk.repeat_interleave(2, dim=1), vv.repeat_interleave(2, dim=1))
            out = _flash(qq, *kv, cu, 56, None, native)
            out.float().square().sum().backward()
            results.append((out, qq.grad, kk.grad, vv.grad))
        # the same math up to bf16 rounding (a wrong head mapping is off by the size of the values)
        return all(((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2
                   for a, b in zip(*results, strict=True))
    except Exception:  # noqa: BLE001 - any failure means: repeat the kv heads
        return False


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None).
    With a `sequence_parallel` keyword (a rayrl.ulysses.SequenceParallel) T is this rank's part of the row, and the
    all-to-all around this function gives it the whole row for its share of the heads."""
    sp = kw.pop("sequence_parallel", None)
    if sp is not None:
        return sp.attention(varlen_attention, module, query, key, value, attention_mask, scaling, dropout, **kw)
    cu, longest = kw.get("cu_seq_lens_q"), kw.get("max_length_q")
    if cu is None or query.shape[0] != 1:
        raise RuntimeError(f"{NAME} attention runs on packed rows only (one row with cu_seq_lens_q); "
                           "the learner passes them when learner.pack is true")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # -> [T, H, D]
    gqa = k.shape[1] != q.shape[1]  # grouped-query attention: each kv head serves Hq / Hkv query heads
    if gqa and not (q.is_cuda and GQA_IN_KERNEL):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    flash = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)  # the flash kernel has no fp32
    out = _flash(q, k, v, cu, longest, scaling, gqa) if flash else _reference(q, k, v, cu, scaling)
    return out.unsqueeze(0), None


@functools.cache
def _varlen_params() -> frozenset[str]:
    """varlen_attn's keyword names in this torch (2.10: is_causal; later: a causal window, enable_gqa), read once:
    inspect inside the forward would break a torch.compile graph."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash(q, k, v, cu, longest: int, scale: float | None, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kw: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if gqa and "enable_gqa" in params:  # the kernel reads the shared kv heads itself: no repeated copy of k and v
        kw["enable_gqa"] = True
    if scale is not None and "scale" in params:
        kw["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-9:
        raise RuntimeError(f"this torch's varlen_attn has no scale argument; the model's scaling is {scale}")
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


def _reference(q, k, v, cu, scale: float | None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bounds = cu.tolist()
    # On CPU the fused flash kernel (it takes 4-d inputs; sdpa picked its unfused math): one attention op per sequence,
    # which checkpointing can keep (model.gradient_checkpointing_keep_attention, rayrl.recompute), as on the GPU
    cpu = q.device.type == "cpu"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]) if cpu else contextlib.nullcontext():
        return torch.cat([F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)),
                                                         is_causal=True, scale=scale)[0].transpose(0, 1)
                          for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


def _no_mask(*args, **kwargs) -> None:
    return None
