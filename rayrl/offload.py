"""Moving a learner's state between GPU and CPU memory, as verl's hybrid engine does (verl.utils.fsdp_utils:
offload_fsdp2_model_to_cpu / load_fsdp_optimizer, which cannot be imported without peft): an FSDP2 model moves
with `module.to` (its sharded DTensor parameters and their gradients), an optimizer state tensor by tensor.
Copies to the CPU land in pinned memory (non_blocking), so the way back is asynchronous too; both run on the
current stream, which orders them before any later kernel. The optimizer state's pinned copies are `PinnedCopies`,
allocated once and packed: torch's pinned allocator rounds every allocation up to a power of two."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


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


def move_optimizer(optim: torch.optim.Optimizer, pinned: PinnedCopies, device: torch.device) -> None:
    """Every state tensor not on `device` to it; to the CPU into `pinned`'s copies (the same ones every time)."""
    moving = {(id(p), key): value for p, state in optim.state.items() for key, value in state.items()
              if isinstance(value, torch.Tensor) and value.device != device}
    to_cpu = device.type == "cpu"
    if to_cpu:
        pinned.reserve(moving)
    for p, state in optim.state.items():
        for key in list(state):
            if (id(p), key) in moving:
                value = state[key]
                state[key] = pinned.copy((id(p), key), value) if to_cpu else value.to(device, non_blocking=True)


class PinnedCopies:
    """Page-locked CPU copies of a set of tensors that keeps its shapes (an optimizer's state), made at the first
    move and reused by every later one. torch's pinned allocator rounds each allocation up to a power of two
    (torch.cuda.memory.host_memory_stats' note), so the state moved tensor by tensor with .to("cpu",
    non_blocking=True), as verl's offload_fsdp_optimizer does, takes up to twice its bytes of host memory: on the
    H200 host the Qwen2.5-7B shape's 61 GB of AdamW state drove the host to 116 GiB of 125 (bench/gpu/results/
    2026-12-05). Here the copies are views into chunks whose sizes are powers of two, each at least the largest
    tensor's (first-fit decreasing), so only a chunk's unused tail is lost. A DTensor's state keeps its local shard
    in the copy."""

    ALIGN = 512  # bytes: every copy starts aligned (any dtype's view, and DMA-friendly)

    def __init__(self, pin: bool = True, min_chunk: int = 256 << 20):
        self.pin, self.min_chunk = pin, min_chunk
        self.slots: dict[Hashable, torch.Tensor] = {}
        self.chunks: list[torch.Tensor] = []

    def reserve(self, tensors: dict[Hashable, torch.Tensor]) -> None:
        """Copies for the tensors that have none of their shape and dtype yet, packed into new chunks."""
        tensors = {k: local(t) for k, t in tensors.items()}
        todo = {k: t for k, t in tensors.items()
                if k not in self.slots or self.slots[k].shape != t.shape or self.slots[k].dtype != t.dtype}
        if not todo:
            return
        size = {k: -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN for k, t in todo.items()}
        cap = max(self.min_chunk, pow2(max(size.values())))
        placed: list[list[tuple[Hashable, int]]] = []
        used: list[int] = []
        for k in sorted(size, key=lambda k: -size[k]):
            i = next((i for i, u in enumerate(used) if u + size[k] <= cap), len(used))
            if i == len(used):
                placed.append([])
                used.append(0)
            placed[i].append((k, used[i]))
            used[i] += size[k]
        for keys, total in zip(placed, used, strict=True):
            chunk = torch.empty(pow2(total), dtype=torch.uint8, pin_memory=self.pin)  # no rounding left to do
            self.chunks.append(chunk)
            for k, at in keys:
                t = todo[k]
                nbytes = t.numel() * t.element_size()
                self.slots[k] = chunk[at : at + nbytes].view(t.dtype).view(t.shape)

    def copy(self, key: Hashable, src: torch.Tensor) -> torch.Tensor:
        """`src` into its copy (asynchronous from a GPU); returns the copy."""
        slot = self.slots[key].copy_(local(src), non_blocking=True)
        if not isinstance(src, DTensor):
            return slot
        # as DTensor's own .to() wraps its result (DTensor.from_local would move the shard to the mesh's GPU)
        return DTensor(slot, src._spec, requires_grad=False)

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def pow2(n: int) -> int:
    """The smallest power of two >= n: what torch's pinned allocator reserves for n bytes."""
    return 1 << max(n - 1, 0).bit_length()


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
