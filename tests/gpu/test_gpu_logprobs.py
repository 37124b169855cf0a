"""GPU-only: the fused log-prob head in bf16 on CUDA, where cuBLAS sums each chunk's weight gradient into the fp32
accumulator itself (`torch.addmm(..., out_dtype=torch.float32)`), equals the float64 computation over the full
logits, dead rows included. Skipped on machines without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped where there is no CUDA GPU (tests/conftest.py)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_head_in_bf16_on_cuda_matches_float64(compiled):
    from rayrl.logprobs import hidden_logprobs

    g = torch.Generator().manual_seed(7)
    n, h, v, temp = 1000, 256, 5003, 0.9
    hidden = (torch.randn(n, h, generator=g) / 4).to("cuda", torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 4).to("cuda", torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).cuda()
    w_lp = (torch.randn(n, generator=g) * (torch.arange(n) % 5 != 0)).cuda()  # every fifth row dead
    lp = hidden_logprobs(hidden, weight, targets, temp, compiled=compiled, chunk=300)
    (lp * w_lp).sum().backward()
    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = ((hd @ wd.t()) / temp).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (ref * w_lp.double()).sum().backward()
    assert weight.grad.dtype == torch.bfloat16
    pairs = (("logprobs", lp, ref), ("hidden grad", hidden.grad, hd.grad), ("weight grad", weight.grad, wd.grad))
    for name, a, b in pairs:
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel < 1e-2, (name, rel)
