"""GPU-only, two GPUs: learner.sequence_parallel=2 over NCCL (torch.compile'd decoder layers; in bf16 the varlen
flash kernel) gives one GPU's log-probs, step statistics, gradients and update; the CPU twin is
tests/unit/test_ulysses.py. Skipped where there are fewer than two CUDA GPUs. bf16 rounds each rank's partial sums
differently: looser bounds, and no weight comparison (AdamW's first steps move a weight by about lr x the sign of its
gradient, which bf16 rounding flips where the gradient is near zero)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import free_port
from tests.unit.test_ulysses import assert_equal_runs, run, sequence_parallel

pytestmark = pytest.mark.gpu  # skipped where there is no CUDA GPU (tests/conftest.py)


@pytest.mark.parametrize(("dtype", "tolerances"), [
    ("float32", {"atol": 1e-4, "rel": 1e-3}),
    ("bfloat16", {"atol": 5e-2, "rel": 5e-2, "grad_rel": (5e-2, 1e-1), "weight_atol": None}),
])
def test_two_gpus_equal_one(tiny_model, tmp_path, dtype, tolerances):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    overrides = ["learner.gpus_per_worker=1", f"model.dtype={dtype}", "algo.entropy_coeff=0.01",
                 "algo.use_kl_loss=true", "algo.kl_loss_coef=0.5"]
    torch.cuda.set_device(0)
    assert_equal_runs(run(tiny_model, overrides, 0, 1, free_port()), sequence_parallel(tiny_model, overrides, tmp_path),
                      overrides, **tolerances)
