"""GPU-only: rayrl_varlen attention (torch's varlen flash kernel on packed rows) equals causal sdpa per sequence,
forward and backward, with grouped kv heads (the 0.5B shape's 14 query / 2 kv heads), whichever way the kernel
takes them (`attention.GQA_IN_KERNEL`, checked once by `register`). Skipped on machines without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped where there is no CUDA GPU (tests/conftest.py)


def test_varlen_attention_matches_sdpa_per_sequence():
    from rayrl import attention

    attention.register()
    print(f"GQA in the kernel: {attention.GQA_IN_KERNEL}")  # noqa: T201 - a figure BENCHMARKS.md reads (pytest -s)
    torch.manual_seed(0)
    lengths = [300, 17, 1024, 511]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = sum(lengths)
    q, k, v = (torch.randn(1, h, T, 64, device="cuda", dtype=torch.bfloat16) for h in (14, 2, 2))
    go = torch.randn(1, T, 14, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for packed in (True, False):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if packed:
            out = attention.varlen_attention(None, qq, kk, vv, None, cu_seq_lens_q=cu, max_length_q=max(lengths))[0]
        else:  # the reference: sdpa, one sequence at a time, kv heads repeated
            kr, vr = (t[0].transpose(0, 1).repeat_interleave(7, dim=1) for t in (kk, vv))
            out = attention._reference(qq[0].transpose(0, 1), kr, vr, cu, None)[None]
        out.backward(go)
        results.append((out, qq.grad, kk.grad, vv.grad))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, (name, rel)
