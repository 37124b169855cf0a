"""cuda_ipc: engine i shares a GPU with learner rank `serving_rank(i)` (colocated placement) and loads from that
rank's flat GPU buffer.

Each serving rank owns one persistent buffer; each sync copies the full parameters (every rank gathers them under
FSDP anyway) into it. The vLLM worker opens the buffer's CUDA IPC handle once and keeps views of it, so a sync is:
copy + synchronize on the learner, then one small collective_rpc that loads from the cached views. Both copies are
fused once known: one rank copies its parameters with one `_foreach_copy_`, and the worker, after its first
`load_weights`, replays it as one `_foreach_copy_` into the parameters (`direct_copies`).
"""

from __future__ import annotations

import pickle
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from rayrl.config import Config
from rayrl.weight_sync.layout import Slot, bucket_nbytes, copy_all, fill, full_tensors, plan, specs, views
from rayrl.weight_sync.worker import engine_llm, load

NAME = "cuda_ipc"


@dataclass
class IpcHandle:
    """What crosses from a serving learner rank to an engine per sync: small (the views' layout and a CUDA IPC
    handle)."""

    buffer_id: str  # changes only if the learner reallocates its buffer; the engine worker reopens then
    blob: bytes  # pickled torch.multiprocessing.reductions.reduce_tensor(buffer)
    slots: list[tuple]  # (name, shape, dtype, offset) per tensor
    device_uuid: str  # the GPU the buffer is on; the worker checks it is on the same one


def serving_rank(engine: int, world_size: int) -> int:
    """The learner rank whose GPU buffer engine `engine` loads from (colocated: engine i, rank i)."""
    return engine % world_size


# --- driver ---------------------------------------------------------------------------------------------

def connect(cfg, learners: list, engines: list, wait: Callable[[dict], dict]) -> None:
    """Nothing to set up: each engine opens its rank's buffer at the first sync."""


def push(learners: list, engines: list, version: int, wait: Callable[[dict], dict]) -> None:
    # A collective: every rank gathers the full tensors; each rank that serves an engine (on its own GPU) copies
    # them into its buffer and returns that buffer's handle.
    serving = {serving_rank(i, len(learners)) for i in range(len(engines))}
    refs = [ln.send_weights.remote(NAME, version, r in serving) for r, ln in enumerate(learners)]
    wait({f"learner/{r}": ref for r, ref in enumerate(refs)})
    wait({f"engine/{i}": eng.receive_weights.remote(NAME, refs[serving_rank(i, len(learners))], version)
          for i, eng in enumerate(engines)})


# --- learner --------------------------------------------------------------------------------------------

class Sender:
    """A learner rank: one flat GPU buffer, allocated at the first serving sync; each sync copies the full
    parameters into it."""

    def __init__(self, cfg: Config, device: torch.device, world_size: int):
        self.dtype, self.device, self.world_size = getattr(torch, cfg.model.dtype), device, world_size
        self.local: list | None = None  # one rank: cached views of the parameters (see `full_tensors`)
        self.buf: torch.Tensor | None = None
        self.views: list[tuple[str, torch.Tensor]] = []
        self.handle: IpcHandle | None = None

    def connect(self, model, setup) -> None:
        pass

    def send(self, model: torch.nn.Module, version: int, serve: bool) -> IpcHandle | None:
        """The full weights copied into this rank's buffer, and its handle, when this rank serves an engine on its
        GPU; None otherwise."""
        if self.world_size == 1:  # the whole model is local: copy it in one go from cached views of the parameters
            if self.local is None:  # nothing gathered on one rank: views that follow every optimizer step
                self.local = list(full_tensors(model))
            tensors = self.local
        else:
            tensors = full_tensors(model)
        if not serve:
            for _ in tensors:  # take part in each all-gather
                pass
            return None
        if self.buf is None:  # allocated once; the engines keep it open
            self._allocate(model)
        # A list (one rank's cached views) in one fused copy, an iterator (several ranks: all-gathers as it goes)
        # one tensor at a time.
        if isinstance(tensors, list):
            copy_all(self.views, tensors)
        else:
            fill(self.views, tensors)
        torch.cuda.synchronize(self.buf.device)  # the engine reads from another process: the copies must be done
        return self.handle

    def _allocate(self, model: torch.nn.Module) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        (bucket,) = plan(specs(model, self.dtype))
        self.buf = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8, device=self.device)
        self.views = views(self.buf, bucket)
        self.handle = IpcHandle(uuid.uuid4().hex, pickle.dumps(reduce_tensor(self.buf)),
                                [(s.name, list(s.shape), s.dtype, s.offset) for s in bucket],
                                str(torch.cuda.get_device_properties(self.device).uuid))

    def params_replaced(self) -> None:
        self.local = None  # rebuilt from the new storage at the next sync

    def close(self) -> None:
        pass


# --- engine ---------------------------------------------------------------------------------------------

class Receiver:
    """The Engine: the handle and the layout cross to its workers once; later syncs send only the buffer's id."""

    def __init__(self):
        self.opened: str | None = None  # the learner buffer the workers hold open
        self.loads: list[str] = []  # how each worker loaded the last sync (`WorkerReceiver.receive`)

    async def connect(self, backend, setup) -> None:
        pass

    async def receive(self, backend, h: IpcHandle) -> None:
        llm = engine_llm(backend, NAME)
        if self.opened != h.buffer_id:
            await llm.collective_rpc("rayrl_connect", args=(NAME, h.buffer_id, h.blob, h.slots, h.device_uuid))
            self.opened = h.buffer_id
        self.loads = await llm.collective_rpc("rayrl_receive", args=(NAME, h.buffer_id))
        await llm.reset_prefix_cache()  # cached KV was computed with the old weights


# --- inside vLLM's worker process -----------------------------------------------------------------------

class WorkerReceiver:
    """The learner's buffer opened once; the views are kept for every later sync."""

    def __init__(self, worker, buffer_id: str, blob: bytes, slots: list, device_uuid: str):
        fn, args = pickle.loads(blob)
        here = torch.cuda.current_device()
        if str(torch.cuda.get_device_properties(here).uuid) != device_uuid:
            raise RuntimeError("engine.weight_sync=cuda_ipc needs the engine on its learner rank's GPU; "
                               "use broadcast (or auto) when they are on different GPUs")
        args = list(args)
        args[6] = here  # the learner's device index may differ from ours for the same GPU
        self.buffer_id = buffer_id
        self.buf = fn(*args)
        self.views = views(self.buf, [Slot(n, tuple(s), d, o) for n, s, d, o in slots])
        self.copies: tuple[list, list] | None = None  # (destinations, sources), once direct_copies checked them
        self.checked = False  # direct_copies ran (once: if the layout has none, every sync keeps load_weights)

    def receive(self, worker, buffer_id: str) -> str:
        """Load from the learner's buffer; returns how: "direct_copies" or "load_weights"."""
        if buffer_id != self.buffer_id:
            raise RuntimeError(f"IPC buffer {buffer_id} was never opened in this worker")
        if self.copies is not None:  # the views never move: the same copies load every later sync
            torch._foreach_copy_(*self.copies)
            torch.cuda.synchronize()
            return "direct_copies"
        load(worker, [self.views])
        if not self.checked:
            self.copies, self.checked = direct_copies(worker.model_runner.get_model(), self.views), True
        return "load_weights"


def direct_copies(model: torch.nn.Module, sources: list[tuple[str, torch.Tensor]]) -> tuple[list, list] | None:
    """What `model.load_weights(sources)` did, as plain copies: (destination views, source tensors) such that
    `torch._foreach_copy_(destinations, sources)` gives every parameter the same value. Call right after that
    load_weights: the plan is kept only if every parameter already equals what it would copy (a parameter that
    is one checkpoint tensor, or several stacked along dim 0 as vLLM's `packed_modules_mapping` fuses q/k/v and
    gate/up, or one tensor in the first rows of a vocabulary-padded one) and every source is used. None otherwise
    (tensor-parallel shards, quantized or repacked layers, tied embeddings...): the caller keeps load_weights."""
    src = dict(sources)
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    used: set[str] = set()
    for name, p in model.named_parameters():
        parts = [name] if name in src else None
        for fused, members in packed.items():
            if parts is None and fused in name.split("."):
                parts = [".".join(m if x == fused else x for x in name.split(".")) for m in members]
        if parts is None or not all(n in src for n in parts):
            return None
        offset = 0
        for n in parts:
            t = src[n]
            if (t.dtype != p.dtype or t.dim() != p.dim() or t.shape[1:] != p.shape[1:]
                    or offset + t.shape[0] > p.shape[0]):
                return None
            dst = p.data.narrow(0, offset, t.shape[0]) if p.dim() else p.data
            if not torch.equal(dst, t):  # load_weights did something other than this copy
                return None
            dsts.append(dst)
            srcs.append(t)
            used.add(n)
            offset += t.shape[0] if p.dim() else 1
        # One source shorter than its parameter: vLLM pads the vocabulary rows of embeddings and lm_head (to a
        # multiple of 64); load_weights fills the first rows and zeroes the rest, which stay zero.
        short_ok = len(parts) == 1 and p.dim() > 0 and not bool(p.data[offset:].any())
        if offset != (p.shape[0] if p.dim() else 1) and not short_ok:
            return None
    return (dsts, srcs) if used == set(src) else None
