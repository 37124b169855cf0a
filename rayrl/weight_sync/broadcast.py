"""broadcast: a process group of learner rank 0 (rank 0) + every engine worker (nccl on GPU, gloo on CPU), made
at `connect` with vLLM's stateless_init_torch_distributed_process_group. Rank 0 sends the layout once, then
each sync broadcasts buckets of `engine.sync_bucket_mb` while the engine workers receive and load them. A restarted
engine is a new process outside the group: the driver forms it again (`connect` once more, every member leaving the
old one; rayrl.recovery.recover).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch

from rayrl.config import Config
from rayrl.weight_sync.layout import Slot, bucket_nbytes, fill, full_tensors, plan, specs, views
from rayrl.weight_sync.worker import engine_llm, load

NAME = "broadcast"


@dataclass
class Group:
    """Where and how to join the group; `rank`: the first rank this learner (0) or engine (one per worker) takes."""

    host: str
    port: int
    rank: int
    world_size: int
    backend: str  # nccl | gloo
    timeout: float


def _group(host: str, port: int, rank: int, world_size: int, backend: str, timeout: float):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    # Stateless: does not touch torch.distributed's default group (the learners' FSDP group, vLLM's own).
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend,
                                                           timeout=timedelta(seconds=timeout))


# --- driver ---------------------------------------------------------------------------------------------

def connect(cfg, learners: list, engines: list, wait: Callable[[dict], dict]) -> None:
    """Form the group: learner rank 0 is rank 0, then every engine's workers in order."""
    e = cfg.engine
    host, port = wait({"learner/0": learners[0].address.remote()})["learner/0"]
    sizes = wait({f"engine/{i}": eng.weight_workers.remote() for i, eng in enumerate(engines)})
    world = 1 + sum(sizes.values())
    backend = "nccl" if e.gpus_per_engine > 0 and cfg.learner.gpus_per_worker > 0 else "gloo"
    joins = {"learner/0": learners[0].connect_weights.remote(NAME, Group(host, port, 0, world, backend,
                                                                             e.sync_timeout))}
    rank = 1
    for i, eng in enumerate(engines):
        joins[f"engine/{i}"] = eng.connect_weights.remote(NAME, Group(host, port, rank, world, backend, e.sync_timeout))
        rank += sizes[f"engine/{i}"]
    wait(joins)


def push(learners: list, engines: list, version: int, wait: Callable[[dict], dict]) -> None:
    # Senders and receivers meet inside the same collectives: they must run at the same time.
    sends = {f"learner/{r}": ln.send_weights.remote(NAME, version, r == 0) for r, ln in enumerate(learners)}
    recvs = {f"engine/{i}": eng.receive_weights.remote(NAME, None, version) for i, eng in enumerate(engines)}
    wait({**sends, **recvs})


# --- learner --------------------------------------------------------------------------------------------

class Sender:
    """Learner rank 0 (rank 0 of the group): sends the layout once at `connect`, then buckets of full tensors each
    sync. The other ranks take part in the gathers only."""

    def __init__(self, cfg: Config, device: torch.device, world_size: int):
        self.dtype, self.bucket_bytes = getattr(torch, cfg.model.dtype), cfg.engine.sync_bucket_mb << 20
        self.pg = None  # the group, once joined
        self.buckets: list[list[Slot]] = []
        self.device: torch.device | None = None
        self.buf: torch.Tensor | None = None

    def connect(self, model: torch.nn.Module, g: Group) -> None:
        self.close()  # a group formed again (an engine restarted, rayrl.recovery) replaces the old one
        self.buckets = plan(specs(model, self.dtype), self.bucket_bytes)
        self.device = torch.device("cuda", torch.cuda.current_device()) if g.backend == "nccl" else torch.device("cpu")
        self.pg = _group(g.host, g.port, g.rank, g.world_size, g.backend, g.timeout)
        meta = torch.frombuffer(bytearray(pickle.dumps(self.buckets)), dtype=torch.uint8).to(self.device)
        self.pg.broadcast(torch.tensor([meta.numel()], dtype=torch.int64, device=self.device), 0).wait()
        self.pg.broadcast(meta, 0).wait()
        self.buf = torch.empty(max(map(bucket_nbytes, self.buckets)), dtype=torch.uint8, device=self.device)

    def send(self, model: torch.nn.Module, version: int, serve: bool) -> None:
        """Every rank gathers each full tensor; the serving rank (0) broadcasts them in buckets."""
        tensors = full_tensors(model)
        if not serve:
            for _ in tensors:
                pass
            return
        if self.pg is None:
            raise RuntimeError("learner/0: engine.weight_sync=broadcast but the weight group was never joined")
        for bucket in self.buckets:
            n = bucket_nbytes(bucket)
            fill(views(self.buf, bucket), tensors)
            # On nccl, wait() orders the broadcast before the next fill on this stream, so one buffer suffices.
            self.pg.broadcast(self.buf[:n], 0).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def params_replaced(self) -> None:
        pass  # reads the parameters afresh each sync

    def release(self) -> None:
        pass  # nothing held for the engines between syncs but one bucket

    def close(self) -> None:
        if self.pg is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.pg)
            self.pg = None


# --- engine ---------------------------------------------------------------------------------------------

class Receiver:
    """The Engine: its workers join at `connect` (ranks g.rank, g.rank+1, ...) and receive while rank 0 sends."""

    async def connect(self, backend, g: Group) -> None:
        await engine_llm(backend, NAME).collective_rpc(
            "rayrl_connect", args=(NAME, g.host, g.port, g.rank, g.world_size, g.backend, g.timeout))

    async def receive(self, backend, payload: None) -> None:
        llm = engine_llm(backend, NAME)
        await llm.collective_rpc("rayrl_receive", args=(NAME,))


# --- inside vLLM's worker process -----------------------------------------------------------------------

class WorkerReceiver:
    """One rank of the group (>= 1): receives the layout at join, then each sync's buckets."""

    def __init__(self, worker, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout: float):
        self.device = device = next(worker.model_runner.get_model().parameters()).device
        self.pg = _group(host, port, rank_offset + getattr(worker, "rank", 0), world_size, backend, timeout)
        n = torch.zeros(1, dtype=torch.int64, device=device)
        self.pg.broadcast(n, 0).wait()
        meta = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
        self.pg.broadcast(meta, 0).wait()
        self.buckets: list[list[Slot]] = pickle.loads(meta.cpu().numpy().tobytes())
        self.buf = torch.empty(max(map(bucket_nbytes, self.buckets)), dtype=torch.uint8, device=device)

    def receive(self, worker) -> int:
        return load(worker, self._buckets())

    def close(self) -> None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        stateless_destroy_torch_distributed_process_group(self.pg)

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yields each bucket's views as it lands. On GPU they share one buffer (valid until the next bucket);
        on CPU each bucket gets its own, since the layerwise reload (`load`) holds a layer's tensors until the
        layer is complete, which may be a bucket later."""
        for bucket in self.buckets:
            n = bucket_nbytes(bucket)
            buf = self.buf if self.device.type == "cuda" else torch.empty(n, dtype=torch.uint8)
            self.pg.broadcast(buf[:n], 0).wait()
            yield views(buf, bucket)
