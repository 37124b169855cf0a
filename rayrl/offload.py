"""Moving a learner's state between GPU and CPU memory, as verl's hybrid engine does (verl.utils.fsdp_utils:
offload_fsdp2_model_to_cpu / load_fsdp_optimizer, which cannot be imported without peft): an FSDP2 model moves
with `module.to` (its sharded DTensor parameters and their gradients), an optimizer state tensor by tensor.
Copies to the CPU land in pinned memory (non_blocking), so the way back is asynchronous too; both run on the
current stream, which orders them before any later kernel."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Moved:
    """One move: what, where to, seconds (until the copies finished), GiB the GPU's allocator freed (negative when
    it took memory)."""

    what: str
    device: str
    seconds: float
    freed_gib: float


def move_model(model: torch.nn.Module, device: torch.device) -> None:
    model.to(device, non_blocking=True)


def move_optimizer(optim: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optim.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=True)


def timed(what: str, device: torch.device, fn, *args) -> Moved:
    """Run one move; on CUDA wait for its copies and give the cached blocks back, so the freed GiB are real."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    before = torch.cuda.memory_reserved() if cuda else 0
    t0 = time.perf_counter()
    fn(*args, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved() if cuda else 0
    return Moved(what, str(device), time.perf_counter() - t0, (before - after) / 2**30)
