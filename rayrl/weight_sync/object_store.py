"""object_store: learner rank 0 gathers the full state dict to CPU and puts one `WeightsPacket` in Ray's object
store; each Engine loads it through its backend (vLLM: a safetensors file in /dev/shm and a reload). A tied model's
lm_head is left out: it is the embedding (`layout.aliases`).

The packet holds numpy arrays, which Ray reads zero-copy out of the object store on the same node, where a pickled
torch tensor would be copied. numpy has no bfloat16, so bf16 tensors travel as int16 bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rayrl.config import Config
from rayrl.weight_sync.layout import aliases

NAME = "object_store"


@dataclass
class WeightsPacket:
    """A full state dict at one policy version."""

    version: int
    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]  # name -> torch dtype name, to undo the bf16 -> int16 view

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def pack(state: dict[str, torch.Tensor], version: int) -> WeightsPacket:
    arrays, dtypes = {}, {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        arrays[name] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return WeightsPacket(version=version, arrays=arrays, dtypes=dtypes)


def unpack(packet: WeightsPacket) -> dict[str, torch.Tensor]:
    out = {}
    for name, a in packet.arrays.items():
        t = torch.from_numpy(np.asarray(a))  # read-only view of the object store; never written
        if packet.dtypes[name] == "bfloat16":
            t = t.view(torch.bfloat16)
        out[name] = t
    return out


# --- driver ---------------------------------------------------------------------------------------------

def connect(cfg, learners: list, engines: list, wait: Callable[[dict], dict]) -> None:
    """Nothing to set up."""


def push(learners: list, engines: list, version: int, wait: Callable[[dict], dict]) -> None:
    refs = [ln.send_weights.remote(NAME, version, r == 0) for r, ln in enumerate(learners)]  # the packet is on rank 0
    wait({f"learner/{r}": ref for r, ref in enumerate(refs) if r > 0})
    wait({f"engine/{i}": eng.receive_weights.remote(NAME, refs[0], version) for i, eng in enumerate(engines)})


# --- learner --------------------------------------------------------------------------------------------

class Sender:
    def __init__(self, cfg: Config, device: torch.device, world_size: int):
        self.dtype = getattr(torch, cfg.model.dtype)  # the engines'

    def connect(self, model, setup) -> None:
        pass

    def send(self, model: torch.nn.Module, version: int, serve: bool) -> WeightsPacket | None:
        """The packet on the serving rank (rank 0, the only one the gather leaves the tensors on), None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Collective: every rank must call. With cpu_offload only rank 0 keeps the gathered tensors.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not serve:
            return None
        tied = aliases(model)  # a tied lm_head travels once, as the embedding (as in cuda_ipc and broadcast)
        return pack({k: v.to(self.dtype) for k, v in state.items() if k not in tied}, version)

    def params_replaced(self) -> None:
        pass  # nothing cached

    def release(self) -> None:
        pass  # nothing on the GPU

    def close(self) -> None:
        pass


# --- engine ---------------------------------------------------------------------------------------------

class Receiver:
    async def connect(self, backend, setup) -> None:
        pass

    async def receive(self, backend, packet: WeightsPacket) -> None:
        await backend.load(unpack(packet))
