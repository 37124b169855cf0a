"""Inside vLLM: the worker extension the strategies' engine sides call, and loading named tensors into the model.

vLLM mixes `WorkerExtension` into each of its worker processes (`worker_extension_cls`); collective_rpc calls its
methods by name with plain arguments, so no pickled functions cross into the engine core.
"""

from __future__ import annotations

from typing import Iterable

import torch


class WorkerExtension:
    """`rayrl_connect` / `rayrl_receive` dispatch by strategy to its `WorkerReceiver` (rayrl.weight_sync.STRATEGIES)."""

    _rayrl_receivers: dict | None = None  # strategy name -> its WorkerReceiver (vLLM never calls a mixin's __init__)

    def rayrl_connect(self, strategy: str, *setup) -> None:
        """Open `strategy`'s receiver in this worker (replacing an earlier one of that strategy)."""
        from rayrl.weight_sync import STRATEGIES  # not at the top: the strategy modules import this one

        if self._rayrl_receivers is None:
            self._rayrl_receivers = {}
        old = self._rayrl_receivers.pop(strategy, None)
        if old is not None and hasattr(old, "close"):  # broadcast: leave the old group (a member of it died)
            old.close()
        self._rayrl_receivers[strategy] = STRATEGIES[strategy].WorkerReceiver(self, *setup)

    def rayrl_receive(self, strategy: str, *args):
        """Load one sync's weights through `strategy`'s receiver; returns what it reports."""
        rx = (self._rayrl_receivers or {}).get(strategy)
        if rx is None:
            raise RuntimeError(f"engine.weight_sync={strategy}: this worker never connected (rayrl_connect)")
        return rx.receive(self, *args)

    def rayrl_reload(self, weights_path: str) -> None:
        """vLLM's own `reload_weights` from a checkpoint folder (object_store's safetensors file), then `retie`."""
        self.reload_weights(weights_path=weights_path)
        retie(self.model_runner.get_model())


def engine_llm(backend, strategy: str):
    """The vLLM AsyncLLM behind an Engine's backend, through which its worker processes are reached."""
    llm = getattr(backend, "llm", None)
    if llm is None:
        raise RuntimeError(f"engine.weight_sync={strategy} needs a started engine with engine.backend=vllm "
                           f"(this one: {type(backend).__name__})")
    return llm


def load(worker, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
    """Load each bucket's (name, tensor) views into the worker's model, in place; returns the tensor count."""
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
        retie(model)
    else:
        # GPU, unquantized: checkpoint format is the kernel format; load_weights copies each view into place.
        for bucket in buckets:
            model.load_weights(bucket)
            n += len(bucket)
        torch.cuda.synchronize()  # the buffer may be overwritten as soon as we return
    return n


def retie(model: torch.nn.Module) -> int:
    """On the CPU build, pack again each module whose weight is an earlier module's (a tied lm_head): the build packs
    the lm_head's GEMM into a copy of the embedding at load, and a (layerwise) reload, which skips the tied name,
    puts the lm_head back as it was, its copy still the old embedding. Returns how many were packed (elsewhere 0:
    the GPU's unquantized lm_head reads the shared weight itself)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    owner: dict[int, torch.nn.Module] = {}
    n = 0
    for module in model.modules():
        w = module._parameters.get("weight")
        if w is None or owner.setdefault(id(w), module) is module:
            continue
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)  # CPU: dispatch_cpu_unquantized_gemm packs it anew
            n += 1
    return n
