"""How weights travel from the learner to the engines: a flat {name: numpy array} through the object store.

numpy arrays are read zero-copy out of Ray's object store on the same node, where a pickled
torch tensor would be copied. numpy has no bfloat16, so bf16 tensors travel as int16 bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
