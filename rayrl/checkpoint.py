"""Atomic checkpoints: write everything into a temp dir, COMPLETE last, fsync it all, then rename it to `step_<k>`.

A kill at any point leaves the previous complete checkpoint usable: `step_<k>` appears whole or not at all (a dir
without COMPLETE, of an older rayrl, is never loaded), and the temp dir of a killed save is removed by the next save.
Layout of `<output_dir>/checkpoints/step_<k>/`: `learner/` (model + optimizer shards, torch.distributed.checkpoint),
`rng_rank<r>.pt`, `trainer_state.json` (step, policy version, data position, driver RNG, the model the run started
from), `COMPLETE`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

MARKER = "COMPLETE"


def root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def latest(output_dir: str) -> str | None:
    """The newest complete checkpoint dir, or None."""
    base = root(output_dir)
    if not os.path.isdir(base):
        return None
    steps = [(int(m.group(1)), d) for d in os.listdir(base) if (m := re.fullmatch(r"step_(\d+)", d))
             and os.path.exists(os.path.join(base, d, MARKER))]
    return os.path.join(base, max(steps)[1]) if steps else None


def begin(output_dir: str, step: int) -> str:
    """A fresh temp dir for step `step` (stale temp dirs from killed saves are removed)."""
    base = root(output_dir)
    os.makedirs(base, exist_ok=True)
    for d in os.listdir(base):
        if d.startswith(".tmp-"):
            shutil.rmtree(os.path.join(base, d), ignore_errors=True)
    tmp = os.path.join(base, f".tmp-step_{step}")
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, step: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write the trainer state and COMPLETE into tmp, fsync, rename tmp -> step_<k>, prune old checkpoints."""
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(str(step))
    _fsync_tree(tmp)  # on disk before the rename makes it the latest (a power loss must not leave it half-written)
    base = os.path.dirname(tmp)
    final = os.path.join(base, f"step_{step}")
    if os.path.exists(final):  # the same step saved before (a run resumed from an older checkpoint)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(base)
    done = sorted(int(d[5:]) for d in os.listdir(base) if d.startswith("step_") and d[5:].isdigit())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(base, f"step_{old}"), ignore_errors=True)
    return final


def _fsync_tree(top: str) -> None:
    for d, _, files in os.walk(top, topdown=False):
        for name in files:
            _fsync(os.path.join(d, name))
        _fsync(d)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def base_model(path: str) -> str:
    """What a checkpoint records as the model a run started from: "smollm2" as it is, a folder as an absolute path."""
    return path if path == "smollm2" else os.path.abspath(path)


def load_state(ckpt: str) -> dict[str, Any]:
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        return json.load(f)
