"""Named tensors in flat byte buffers: the layout the cuda_ipc and broadcast strategies share.

A `plan` places (name, shape, dtype) in order into buckets; sender and receiver build the same `views` of a bucket's
uint8 buffer, so only the bytes cross. `full_tensors` reads a (possibly FSDP-sharded) model in that order. A tensor
that several names share (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`) travels once, under its
first name (`aliases`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

ALIGN = 256  # bytes: every tensor starts at an offset any dtype can be viewed at


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in its bucket's flat uint8 buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name: "bfloat16", "float32", ...
    offset: int  # bytes from the bucket's start

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan(specs: Iterable[tuple[str, tuple[int, ...], str]], bucket_bytes: int | None = None) -> list[list[Slot]]:
    """Pack (name, shape, dtype) in order into buckets of at most `bucket_bytes` (None: one bucket).
    A tensor larger than a bucket gets a bucket of its own."""
    buckets: list[list[Slot]] = []
    cur: list[Slot] = []
    used = 0
    for name, shape, dtype in specs:
        slot = Slot(name, tuple(int(d) for d in shape), dtype, 0)
        start = -(-used // ALIGN) * ALIGN
        if cur and bucket_bytes is not None and start + slot.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, start = [], 0
        cur.append(Slot(slot.name, slot.shape, dtype, start))
        used = start + slot.nbytes
    if cur:
        buckets.append(cur)
    return buckets


def bucket_nbytes(bucket: list[Slot]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes if bucket else 0


def views(buf: torch.Tensor, bucket: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a flat uint8 buffer, one per slot; no copy."""
    return [(s.name, buf[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)) for s in bucket]


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: first name} for state-dict entries that are the same tensor as an earlier entry: a tied model's
    `lm_head.weight` -> `model.embed_tokens.weight` (also under FSDP2, which keeps one sharded Parameter for both).
    vLLM loads a tied model from the first name and skips the alias; transformers ties it back at load."""
    first: dict[int, str] = {}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():  # keep_vars: the Parameters themselves, not detached
        if first.setdefault(id(t), name) != name:
            out[name] = first[id(t)]
    return out


def _unique_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's (name, tensor) in order, each shared tensor once (`aliases`)."""
    tied = aliases(model)
    return ((name, t) for name, t in model.state_dict(keep_vars=True).items() if name not in tied)


def specs(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full shape, dtype on the wire) of a (possibly FSDP-sharded) model's state dict, each shared tensor
    once (`aliases`); no communication."""
    out = []
    for name, t in _unique_state(model):
        wire = dtype if t.is_floating_point() else t.dtype
        out.append((name, tuple(t.shape), str(wire).removeprefix("torch.")))  # a DTensor's shape is the full one
    return out


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each full tensor in state-dict order (a shared one once, as in `specs`), on the model's device, in the model's
    own dtype (`fill` casts while it copies: no temporary). A collective under FSDP: every rank must consume the
    whole iterator, in step (DTensor.full_tensor() all-gathers one tensor at a time). On one rank nothing is
    gathered: the tensors are views of the parameters' storage, which optimizer steps update in place, so a caller
    may keep `list(...)` of them across steps (and must rebuild it when the parameters are replaced, e.g. by a
    checkpoint load)."""
    from torch.distributed.tensor import DTensor

    for name, t in _unique_state(model):
        if isinstance(t, DTensor):  # one rank: the local shard is the whole tensor, no collective needed
            t = t.full_tensor() if t.device_mesh.size() > 1 else t.to_local()
        yield name, t.detach()


def copy_all(bucket_views: list[tuple[str, torch.Tensor]], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """`fill` for a list given at once: the same name check, then one fused `_foreach_copy_` (casting where the
    dtypes differ) instead of one Python-level copy per tensor."""
    want, got = [n for n, _ in bucket_views], [n for n, _ in tensors]
    if want != got:
        i = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        raise RuntimeError(f"weight sync layout out of date: expected {want[i] if i < len(want) else None!r}, "
                           f"the model gave {got[i] if i < len(got) else None!r}")
    pairs = zip(bucket_views, tensors, strict=True)
    torch._foreach_copy_([v for _, v in bucket_views], [t.view(v.shape) for (_, v), (_, t) in pairs])


def fill(bucket_views: list[tuple[str, torch.Tensor]], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy the next len(bucket_views) tensors into the views, casting to each view's dtype (names must match:
    same state-dict order)."""
    for name, view in bucket_views:
        got, t = next(tensors)
        if got != name:
            raise RuntimeError(f"weight sync layout out of date: expected {name!r}, the model gave {got!r}")
        view.copy_(t.reshape(view.shape))
