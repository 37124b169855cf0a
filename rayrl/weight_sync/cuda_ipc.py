"""cuda_ipc: engine i shares a GPU with learner rank `serving_rank(i)` (colocated placement) and loads from that
rank's flat GPU buffer.

Each serving rank owns one buffer of the full parameters; each sync copies them (every rank gathers them under FSDP
anyway) into it. The vLLM worker opens the buffer's CUDA IPC handle and keeps views of it, so a sync is: copy +
synchronize on the learner, then one small collective_rpc that loads from the views. Both copies are fused once
known: one rank copies its parameters with one `_foreach_copy_`, and the worker, after its first `load_weights`,
replays it as one `_foreach_copy_` into the parameters (`direct_copies`, kept by tensor name).

The buffer lives between syncs, opened once, unless the engines sleep (`engine.sleep_level`): then it exists only
for the sync — the worker closes its mapping after loading and the learner frees it (`Sender.release`, called when
the learner offloads), so the engine's KV cache can wake into the memory it took (a 4B model's buffer is 8 GB).
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
    keep_open: bool = True  # False (sleeping engines): the worker closes the buffer after loading; the learner frees it


def serving_rank(engine: int, world_size: int) -> int:
    """The learner rank whose GPU buffer engine `engine` loads from (colocated: engine i on rank i % ranks' GPU)."""
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
        self.keep_open = cfg.engine.sleep_level == 0  # sleeping engines: the buffer exists for the sync only

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
        if self.buf is None:  # allocated once (or once per sync, after `release`); the engines open it
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
                                str(torch.cuda.get_device_properties(self.device).uuid), self.keep_open)

    def params_replaced(self) -> None:
        self.local = None  # rebuilt from the new storage at the next sync

    def release(self) -> None:
        """Free the buffer until the next sync (only when the engines do not keep it open: they closed it)."""
        if self.buf is None or self.keep_open:
            return
        self.buf, self.views, self.handle = None, [], None
        torch.cuda.ipc_collect()  # the block returns to the allocator once the engine's mapping is closed
        torch.cuda.empty_cache()

    def close(self) -> None:
        pass


# --- engine ---------------------------------------------------------------------------------------------

class Receiver:
    """The Engine: the handle and the layout cross to its workers once; later syncs send only the buffer's id."""

    def __init__(self):
        self.connected = False  # the workers have a WorkerReceiver
        self.opened: str | None = None  # the learner buffer the workers hold open
        self.loads: list[str] = []  # how each worker loaded the last sync (`WorkerReceiver.receive`)

    async def connect(self, backend, setup) -> None:
        pass

    async def receive(self, backend, h: IpcHandle) -> None:
        llm = engine_llm(backend, NAME)
        where = (h.blob, h.slots, h.device_uuid)
        if not self.connected:
            await llm.collective_rpc("rayrl_connect", args=(NAME, h.buffer_id, *where))
            self.connected, self.opened = True, h.buffer_id
        new = None if self.opened == h.buffer_id else where  # a new buffer: the workers open it first
        self.loads = await llm.collective_rpc("rayrl_receive", args=(NAME, h.buffer_id, new, not h.keep_open))
        self.opened = h.buffer_id if h.keep_open else None


# --- inside vLLM's worker process -----------------------------------------------------------------------

class WorkerReceiver:
    """The learner's buffer opened (once, or once per sync when it is not kept open) and views of it."""

    def __init__(self, worker, buffer_id: str, blob: bytes, slots: list, device_uuid: str):
        self.buffer_id: str | None = None
        self.views: list[tuple[str, torch.Tensor]] = []
        self.copies: tuple[list, list[str]] | None = None  # (destinations, source names), once direct_copies found it
        self.checked = False  # direct_copies ran (once: if the layout has none, every sync keeps load_weights)
        self._open(buffer_id, blob, slots, device_uuid)

    def _open(self, buffer_id: str, blob: bytes, slots: list, device_uuid: str) -> None:
        fn, args = pickle.loads(blob)
        here = torch.cuda.current_device()
        if str(torch.cuda.get_device_properties(here).uuid) != device_uuid:
            raise RuntimeError("engine.weight_sync=cuda_ipc needs the engine on its learner rank's GPU; "
                               "use broadcast (or auto) when they are on different GPUs")
        args = list(args)
        args[6] = here  # the learner's device index may differ from ours for the same GPU
        self.buffer_id = buffer_id
        self.views = views(fn(*args), [Slot(n, tuple(s), d, o) for n, s, d, o in slots])

    def receive(self, worker, buffer_id: str, new: tuple | None = None, close: bool = False) -> str:
        """Load from the learner's buffer (opening it first when `new` carries a new one's blob, slots and device;
        closing it after when `close`); returns how: "direct_copies" or "load_weights"."""
        if buffer_id != self.buffer_id:
            if new is None:
                raise RuntimeError(f"IPC buffer {buffer_id} was never opened in this worker")
            self._open(buffer_id, *new)
        if self.copies is not None:  # the same copies load every later sync, from whichever buffer holds the names
            named = dict(self.views)
            torch._foreach_copy_(self.copies[0], [named[n] for n in self.copies[1]])
            torch.cuda.synchronize()
            how = "direct_copies"
        else:
            load(worker, [self.views])
            if not self.checked:
                found, self.checked = direct_copies(worker.model_runner.get_model(), self.views), True
                if found is not None:
                    names = {id(t): n for n, t in self.views}
                    self.copies = (found[0], [names[id(t)] for t in found[1]])
            how = "load_weights"
        if close:  # the last reference to the mapping: the learner can free the buffer
            self.buffer_id, self.views = None, []
        return how


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
