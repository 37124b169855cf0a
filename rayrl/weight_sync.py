"""How weights travel from the learner to the engines (`engine.weight_sync`), one strategy per section.

- object_store: learner rank 0 gathers the full state dict to CPU -> `WeightsPacket` (rayrl/weights.py) in Ray's
  object store -> each Engine writes it to /dev/shm and reloads. Works everywhere (CPU, hf backend); slowest.
- cuda_ipc: engine i shares a GPU with learner rank i (mod the world size; colocated placement). Each serving
  rank owns one persistent flat GPU buffer; each sync copies the full parameters (every rank gathers them under
  FSDP anyway) into it. The vLLM worker opens the buffer's CUDA IPC handle once and keeps views of it, so a
  sync is: copy + synchronize on the learner, then one small collective_rpc that loads from the cached views.
  Both copies are fused once known: one rank copies its parameters with one `_foreach_copy_`, and the worker,
  after its first `load_weights`, replays it as one `_foreach_copy_` into the parameters (`direct_copies`).
- broadcast: a process group of learner rank 0 + every engine worker (nccl on GPU, gloo on CPU), made once with
  vLLM's stateless_init_torch_distributed_process_group. Rank 0 sends the layout once, then each sync broadcasts
  buckets of `engine.sync_bucket_mb` while the engine workers receive and load them.
- auto: cuda_ipc when every engine sits on its serving rank's GPU, broadcast when they are on GPUs otherwise,
  object_store on CPU.

The learner side lives in `Learner` (rayrl/actors/learner.py, "weights out"), the engine side in `Engine` and,
inside vLLM's worker process, in `WorkerExtension` (vLLM's `worker_extension_cls`): collective_rpc calls its
methods by name with plain arguments, so no pickled functions cross into the engine core.

Every wait has a timeout (`engine.sync_timeout`); a failure raises one line that names the actor.
"""

from __future__ import annotations

import pickle
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch

ALIGN = 256  # bytes: every tensor starts at an offset any dtype can be viewed at


# --- layout: named tensors in flat byte buffers ------------------------------------------------------

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


def specs(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full shape, dtype on the wire) of a (possibly FSDP-sharded) model's state dict; no communication."""
    out = []
    for name, t in model.state_dict().items():
        wire = dtype if t.is_floating_point() else t.dtype
        out.append((name, tuple(t.shape), str(wire).removeprefix("torch.")))  # a DTensor's shape is the full one
    return out


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each full tensor in state-dict order, on the model's device, in the model's own dtype (`fill` casts while it
    copies: no temporary). A collective under FSDP: every rank must consume the whole iterator, in step
    (DTensor.full_tensor() all-gathers one tensor at a time). On one rank nothing is gathered: the tensors are views
    of the parameters' storage, which optimizer steps update in place, so a caller may keep `list(...)` of them
    across steps (and must rebuild it when the parameters are replaced, e.g. by a checkpoint load)."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):  # one rank: the local shard is the whole tensor, no collective needed
            t = t.full_tensor() if t.device_mesh.size() > 1 else t.to_local()
        yield name, t.detach()


def copy_all(bucket_views: list[tuple[str, torch.Tensor]], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """`fill` for a list given at once: the same name check, then one fused `_foreach_copy_` (casting where the
    dtypes differ) instead of one Python-level copy per tensor."""
    want, got = [n for n, _ in bucket_views], [n for n, _ in tensors]
    if want != got:
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise RuntimeError(f"weight sync layout out of date: expected {want[i] if i < len(want) else None!r}, "
                           f"the model gave {got[i] if i < len(got) else None!r}")
    torch._foreach_copy_([v for _, v in bucket_views], [t.view(v.shape) for (_, v), (_, t) in zip(bucket_views, tensors)])


def fill(bucket_views: list[tuple[str, torch.Tensor]], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy the next len(bucket_views) tensors into the views, casting to each view's dtype (names must match:
    same state-dict order)."""
    for name, view in bucket_views:
        got, t = next(tensors)
        if got != name:
            raise RuntimeError(f"weight sync layout out of date: expected {name!r}, the model gave {got!r}")
        view.copy_(t.reshape(view.shape))


# --- choosing a strategy ------------------------------------------------------------------------------

def local_gpus() -> tuple[str, tuple[str, ...]]:
    """(node id, GPU ids Ray gave this actor): two actors share a GPU iff both match."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))


def serving_rank(engine: int, world_size: int) -> int:
    """The learner rank whose GPU buffer engine `engine` loads from under cuda_ipc (colocated: engine i, rank i)."""
    return engine % world_size


def resolve(mode: str, backend: str, learner_gpus: list[tuple], engine_gpus: list[tuple]) -> str:
    """`auto` -> a concrete strategy, from where the learner ranks and the engines run (see `local_gpus`):
    cuda_ipc when every engine i shares a GPU with learner rank `serving_rank(i)`, broadcast when they are on
    GPUs otherwise, object_store on CPU or with the hf backend."""
    if mode != "auto":
        return mode
    if backend != "vllm" or any(not g[1] for g in [*learner_gpus, *engine_gpus]):
        return "object_store"
    if all(_same_gpu(g, learner_gpus[serving_rank(i, len(learner_gpus))]) for i, g in enumerate(engine_gpus)):
        return "cuda_ipc"
    return "broadcast"


def _same_gpu(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and bool(set(a[1]) & set(b[1]))


def connect(cfg, learners: list, engines: list) -> str:
    """Resolve `engine.weight_sync` and, for broadcast, form the process group (learner rank 0 = rank 0,
    then every engine worker). Returns the strategy `push` will use."""
    import ray

    e = cfg.engine
    mode = e.weight_sync
    if mode == "auto":
        places = ray.get([ln.gpus.remote() for ln in learners] + [eng.gpus.remote() for eng in engines],
                         timeout=e.sync_timeout)
        mode = resolve(mode, e.backend, places[:len(learners)], places[len(learners):])
    if mode == "broadcast":
        host, port = ray.get(learners[0].address.remote(), timeout=e.sync_timeout)
        sizes = ray.get([eng.weight_workers.remote() for eng in engines], timeout=e.sync_timeout)
        world = 1 + sum(sizes)
        backend = "nccl" if e.gpus_per_engine > 0 and cfg.learner.gpus_per_worker > 0 else "gloo"
        joins = {"learner/0": learners[0].join_weight_group.remote(host, port, world, backend)}
        offset = 1
        for i, (eng, n) in enumerate(zip(engines, sizes)):
            joins[f"engine/{i}"] = eng.join_weight_group.remote(host, port, offset, world, backend)
            offset += n
        wait(joins, e.sync_timeout, "broadcast group setup")
    return mode


def push(mode: str, learners: list, engines: list, version: int, timeout: float) -> None:
    """One sync of every engine to the learners' current weights at `version` (all learner ranks take part)."""
    if mode == "object_store":
        refs = [ln.weights.remote(version) for ln in learners]  # a collective; the packet is on rank 0
        wait({f"learner/{r}": ref for r, ref in enumerate(refs) if r > 0}, timeout, mode)
        wait({f"engine/{i}": eng.update_weights.remote(refs[0]) for i, eng in enumerate(engines)}, timeout, mode)
    elif mode == "cuda_ipc":
        # A collective: every rank gathers the full tensors; each rank that serves an engine (on its own GPU)
        # copies them into its buffer and returns that buffer's handle.
        serving = {serving_rank(i, len(learners)) for i in range(len(engines))}
        refs = [ln.ipc_handle.remote(r in serving) for r, ln in enumerate(learners)]
        wait({f"learner/{r}": ref for r, ref in enumerate(refs)}, timeout, mode)
        wait({f"engine/{i}": eng.load_ipc.remote(refs[serving_rank(i, len(learners))], version)
              for i, eng in enumerate(engines)}, timeout, mode)
    elif mode == "broadcast":
        # Senders and receivers meet inside the same collectives: they must run at the same time.
        sends = {f"learner/{r}": ln.send_weights.remote() for r, ln in enumerate(learners)}
        recvs = {f"engine/{i}": eng.receive_weights.remote(version) for i, eng in enumerate(engines)}
        wait({**sends, **recvs}, timeout, mode)
    else:
        raise ValueError(f"unknown weight sync strategy {mode!r} (object_store, cuda_ipc or broadcast)")


def wait(named: dict, timeout: float, what: str) -> None:
    """Wait for every ref; the first failure or the timeout raises one line naming the actor(s)."""
    import ray

    deadline = time.monotonic() + timeout
    by_ref = {ref: name for name, ref in named.items()}
    pending = list(by_ref)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()),
                                  fetch_local=False)
        if not ready:
            names = ", ".join(by_ref[r] for r in pending)
            raise TimeoutError(f"weight sync ({what}): {names} did not finish within engine.sync_timeout={timeout:g}s")
        try:
            ray.get(ready[0])
        except Exception as ex:  # noqa: BLE001 - re-raised as one line naming the actor
            cause = getattr(ex, "cause", None) or ex
            lines = str(cause).strip().splitlines()
            raise RuntimeError(f"weight sync ({what}) failed on {by_ref[ready[0]]}: {type(cause).__name__}: "
                               f"{lines[0] if lines else ''}") from None


# --- cuda_ipc -----------------------------------------------------------------------------------------

@dataclass
class IpcHandle:
    """What crosses from learner rank 0 to an engine per sync: small (the views' layout and a CUDA IPC handle)."""

    buffer_id: str  # changes only if the learner reallocates its buffer; the engine worker reopens then
    blob: bytes  # pickled torch.multiprocessing.reductions.reduce_tensor(buffer)
    slots: list[tuple]  # (name, shape, dtype, offset) per tensor
    device_uuid: str  # the GPU the buffer is on; the worker checks it is on the same one


class IpcSender:
    """Learner rank 0: one flat GPU buffer, allocated once; `update` copies the parameters into it."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        (self.bucket,) = plan(specs(model, dtype))
        self.buf = torch.empty(bucket_nbytes(self.bucket), dtype=torch.uint8, device=device)
        self.views = views(self.buf, self.bucket)
        from torch.multiprocessing.reductions import reduce_tensor

        self.handle = IpcHandle(uuid.uuid4().hex, pickle.dumps(reduce_tensor(self.buf)),
                                [(s.name, list(s.shape), s.dtype, s.offset) for s in self.bucket],
                                str(torch.cuda.get_device_properties(device).uuid))

    def update(self, tensors: Iterator[tuple[str, torch.Tensor]] | list[tuple[str, torch.Tensor]]) -> IpcHandle:
        """Copy the full tensors in: a list (one rank's cached `full_tensors`) in one fused copy, an iterator
        (several ranks: `full_tensors`, which all-gathers as it goes) one at a time."""
        if isinstance(tensors, list):
            copy_all(self.views, tensors)
        else:
            fill(self.views, tensors)
        torch.cuda.synchronize(self.buf.device)  # the engine reads from another process: the copies must be done
        return self.handle


class IpcReceiver:
    """Engine worker: the learner's buffer opened once; the views are kept for every later sync."""

    def __init__(self, handle_blob: bytes, slots: list, device_uuid: str):
        fn, args = pickle.loads(handle_blob)
        here = torch.cuda.current_device()
        if str(torch.cuda.get_device_properties(here).uuid) != device_uuid:
            raise RuntimeError("engine.weight_sync=cuda_ipc needs the engine on learner rank 0's GPU; "
                               "use broadcast (or auto) when they are on different GPUs")
        args = list(args)
        args[6] = here  # the learner's device index may differ from ours for the same GPU
        self.buf = fn(*args)
        self.views = views(self.buf, [Slot(n, tuple(s), d, o) for n, s, d, o in slots])
        self.copies: tuple[list, list] | None = None  # (destinations, sources), once direct_copies checked them
        self.checked = False  # direct_copies ran (once: if the layout has none, every sync keeps load_weights)


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
            if t.dtype != p.dtype or t.dim() != p.dim() or t.shape[1:] != p.shape[1:] or offset + t.shape[0] > p.shape[0]:
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


# --- broadcast ----------------------------------------------------------------------------------------

def _group(host: str, port: int, rank: int, world_size: int, backend: str, timeout: float):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    # Stateless: does not touch torch.distributed's default group (the learners' FSDP group, vLLM's own).
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend,
                                                           timeout=timedelta(seconds=timeout))


class BroadcastSender:
    """Learner rank 0 (rank 0 of the group): sends the layout once, then buckets of full tensors each sync."""

    def __init__(self, model, dtype, bucket_bytes: int, host, port, world_size, backend, timeout):
        self.buckets = plan(specs(model, dtype), bucket_bytes)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.pg = _group(host, port, 0, world_size, backend, timeout)
        meta = torch.frombuffer(bytearray(pickle.dumps(self.buckets)), dtype=torch.uint8).to(self.device)
        self.pg.broadcast(torch.tensor([meta.numel()], dtype=torch.int64, device=self.device), 0).wait()
        self.pg.broadcast(meta, 0).wait()
        self.buf = torch.empty(max(map(bucket_nbytes, self.buckets)), dtype=torch.uint8, device=self.device)

    def send(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        for bucket in self.buckets:
            n = bucket_nbytes(bucket)
            fill(views(self.buf, bucket), tensors)
            # On nccl, wait() orders the broadcast before the next fill on this stream, so one buffer suffices.
            self.pg.broadcast(self.buf[:n], 0).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        stateless_destroy_torch_distributed_process_group(self.pg)


class BroadcastReceiver:
    """Engine worker (rank >= 1): receives the layout at join, then each sync's buckets."""

    def __init__(self, host, port, rank, world_size, backend, timeout, device: torch.device):
        self.device = device
        self.pg = _group(host, port, rank, world_size, backend, timeout)
        n = torch.zeros(1, dtype=torch.int64, device=device)
        self.pg.broadcast(n, 0).wait()
        meta = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
        self.pg.broadcast(meta, 0).wait()
        self.buckets: list[list[Slot]] = pickle.loads(meta.cpu().numpy().tobytes())
        self.buf = torch.empty(max(map(bucket_nbytes, self.buckets)), dtype=torch.uint8, device=device)

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yields each bucket's views as it lands. On GPU they share one buffer (valid until the next bucket);
        on CPU each bucket gets its own, since the layerwise reload (`_load`) holds a layer's tensors until the
        layer is complete, which may be a bucket later."""
        for bucket in self.buckets:
            n = bucket_nbytes(bucket)
            buf = self.buf if self.device.type == "cuda" else torch.empty(n, dtype=torch.uint8)
            self.pg.broadcast(buf[:n], 0).wait()
            yield views(buf, bucket)


# --- inside vLLM's worker process ---------------------------------------------------------------------

class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls="rayrl.weight_sync.WorkerExtension"`); the Engine calls
    these by name through collective_rpc."""

    def rayrl_ipc_load(self, buffer_id: str, blob: bytes | None, slots: list | None, device_uuid: str | None) -> str:
        """Load from the learner's buffer; returns how: "direct_copies" or "load_weights"."""
        rx = getattr(self, "_rayrl_ipc", None)
        if rx is None or rx[0] != buffer_id:
            if blob is None:
                raise RuntimeError(f"IPC buffer {buffer_id} was never opened in this worker")
            self._rayrl_ipc = rx = (buffer_id, IpcReceiver(blob, slots, device_uuid))
        r = rx[1]
        if r.copies is not None:  # the views never move: the same copies load every later sync
            torch._foreach_copy_(*r.copies)
            torch.cuda.synchronize()
            return "direct_copies"
        _load(self, [r.views])
        if not r.checked:
            r.copies, r.checked = direct_copies(self.model_runner.get_model(), r.views), True
        return "load_weights"

    def rayrl_join_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                         timeout: float) -> None:
        device = next(self.model_runner.get_model().parameters()).device
        self._rayrl_bcast = BroadcastReceiver(host, port, rank_offset + getattr(self, "rank", 0), world_size, backend,
                                              timeout, device)

    def rayrl_receive(self) -> int:
        rx = getattr(self, "_rayrl_bcast", None)
        if rx is None:
            raise RuntimeError("engine.weight_sync=broadcast: this worker never joined the weight group")
        return _load(self, rx.receive())


def _load(worker, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
    """Load each bucket's (name, tensor) views into the worker's model, in place."""
    from vllm.platforms import current_platform

    model = worker.model_runner.get_model()
    n = 0
    if current_platform.is_cpu():
        # The CPU build repacks some weights after loading (e.g. for its GEMM kernels): a plain load_weights
        # cannot reach them. vLLM's layerwise reload re-runs that processing as each layer completes.
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(model)
        for bucket in buckets:
            model.load_weights(bucket)
            n += len(bucket)
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    else:
        # GPU, unquantized: checkpoint format is the kernel format; load_weights copies each view into place.
        for bucket in buckets:
            model.load_weights(bucket)
            n += len(bucket)
        torch.cuda.synchronize()  # the buffer may be overwritten as soon as we return
    return n
