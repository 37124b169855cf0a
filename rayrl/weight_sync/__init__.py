"""How weights travel from the learner to the engines (`engine.weight_sync`): the driver side and the table of
strategies.

- object_store: a packet of the full state dict through Ray's object store; works everywhere (CPU, hf); slowest.
- cuda_ipc: each engine loads from a GPU buffer of the learner rank on its own GPU (colocated placement).
- broadcast: learner rank 0 sends buckets to every engine worker over a process group (nccl on GPU, gloo on CPU).
- auto: cuda_ipc when every engine sits on its serving rank's GPU, broadcast when they are on GPUs otherwise,
  object_store on CPU.

Each strategy is one module holding every side of it: the driver's `connect(cfg, learners, engines, wait)` (one-time
setup) and `push(learners, engines, version, wait)` (one sync), where `wait` is `wait` below with the timeout bound;
the learner's `Sender`; the Engine's `Receiver`; and, where it loads inside vLLM's worker processes, the
`WorkerReceiver` that `worker.WorkerExtension` dispatches to. Adding a strategy is a module and a line in
`STRATEGIES` (and its name in config.py's check). The actors reach them through one method each way, naming the
strategy: `Learner.connect_weights` / `send_weights`, `Engine.connect_weights` / `receive_weights`.

Every wait has a timeout (`engine.sync_timeout`); a failure raises one line that names the actor.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Protocol

from rayrl.weight_sync import broadcast, cuda_ipc, object_store

STRATEGIES = {"object_store": object_store, "cuda_ipc": cuda_ipc, "broadcast": broadcast}


class Sender(Protocol):
    """A strategy's learner side, one per learner rank: `Sender(cfg, device, world_size)`."""

    def connect(self, model, setup) -> None:
        """One-time setup from the driver's `connect` (broadcast: join the group)."""

    def send(self, model, version: int, serve: bool) -> Any:
        """One sync; every rank calls (the gathers are collectives). `serve`: this rank delivers the weights.
        Returns what the engines' `Receiver.receive` gets, or None."""

    def params_replaced(self) -> None:
        """The model's parameters may have new storage (a checkpoint load): drop anything that points into it."""

    def release(self) -> None:
        """Free the GPU memory held between syncs where the engines do not keep it (cuda_ipc beside sleeping
        engines); called when the learner gives the GPU to the engines."""

    def close(self) -> None: ...


class Receiver(Protocol):
    """A strategy's Engine side: `Receiver()`. `backend` is the Engine's: `load(state)` on every backend, `llm` (vLLM's
    AsyncLLM, to reach its worker processes) on vLLM."""

    async def connect(self, backend, setup) -> None: ...

    async def receive(self, backend, payload) -> None: ...


def local_gpus() -> tuple[str, tuple[str, ...]]:
    """(node id, GPU ids Ray gave this actor): two actors share a GPU iff both match."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))


def resolve(mode: str, backend: str, learner_gpus: list[tuple], engine_gpus: list[tuple]) -> str:
    """`auto` -> a concrete strategy, from where the learner ranks and the engines run (see `local_gpus`):
    cuda_ipc when every engine i shares a GPU with learner rank `cuda_ipc.serving_rank(i)`, broadcast when they are
    on GPUs otherwise, object_store on CPU or with the hf backend."""
    if mode != "auto":
        return mode
    if backend != "vllm" or any(not g[1] for g in [*learner_gpus, *engine_gpus]):
        return "object_store"
    if all(_same_gpu(g, learner_gpus[cuda_ipc.serving_rank(i, len(learner_gpus))]) for i, g in enumerate(engine_gpus)):
        return "cuda_ipc"
    return "broadcast"


def _same_gpu(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and bool(set(a[1]) & set(b[1]))


def connect(cfg, learners: list, engines: list, mode: str | None = None) -> str:
    """Resolve `engine.weight_sync` (or take the resolved `mode`, to form a broadcast group again after an engine's
    restart) and run the strategy's setup (broadcast: form the process group). Returns the strategy `push` will use."""
    timeout = cfg.engine.sync_timeout
    mode = mode or cfg.engine.weight_sync
    if mode == "auto":
        places = wait({**{f"learner/{r}": ln.gpus.remote() for r, ln in enumerate(learners)},
                       **{f"engine/{i}": eng.gpus.remote() for i, eng in enumerate(engines)}}, timeout, "auto")
        mode = resolve(mode, cfg.engine.backend, [places[f"learner/{r}"] for r in range(len(learners))],
                       [places[f"engine/{i}"] for i in range(len(engines))])
    _strategy(mode).connect(cfg, learners, engines, functools.partial(wait, timeout=timeout, what=f"{mode} setup"))
    return mode


def push(mode: str, learners: list, engines: list, version: int, timeout: float) -> None:
    """One sync of every engine to the learners' current weights at `version` (all learner ranks take part)."""
    _strategy(mode).push(learners, engines, version, functools.partial(wait, timeout=timeout, what=mode))


def _strategy(mode: str):
    if mode not in STRATEGIES:
        raise ValueError(f"unknown weight sync strategy {mode!r} ({', '.join(STRATEGIES)})")
    return STRATEGIES[mode]


def wait(named: dict, timeout: float, what: str) -> dict[str, Any]:
    """Wait for every ref and return {name: value}; the first failure or the timeout raises one line naming the
    actor(s)."""
    import ray

    deadline = time.monotonic() + timeout
    by_ref = {ref: name for name, ref in named.items()}
    pending = list(by_ref)
    out = {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()),
                                  fetch_local=False)
        if not ready:
            names = ", ".join(by_ref[r] for r in pending)
            raise TimeoutError(f"weight sync ({what}): {names} did not finish within engine.sync_timeout={timeout:g}s")
        try:
            out[by_ref[ready[0]]] = ray.get(ready[0])
        except Exception as ex:  # noqa: BLE001 - re-raised as one line naming the actor
            cause = getattr(ex, "cause", None) or ex
            lines = str(cause).strip().splitlines()
            raise RuntimeError(f"weight sync ({what}) failed on {by_ref[ready[0]]}: {type(cause).__name__}: "
                               f"{lines[0] if lines else ''}") from None
    return out
