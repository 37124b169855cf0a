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
import sys
from typing import Any

from rayrl.config import ConfigError

MARKER = "COMPLETE"
KEEP = 2  # complete checkpoints kept (commit's default)
# what one checkpoint holds per parameter: the learner's fp32 master weights and AdamW's two fp32 moments
BYTES_PER_PARAM = 12


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


def commit(tmp: str, step: int, state: dict[str, Any], keep: int = KEEP) -> str:
    """Write the trainer state and COMPLETE into tmp, fsync, rename tmp -> step_<k>, prune old checkpoints."""
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(str(step))
    _fsync_tree(tmp)  # on disk before the rename makes it the latest (a power loss must not leave it half-written)
    base = os.path.dirname(tmp)
    final = os.path.join(base, f"step_{step}")
    if os.path.exists(final):  # the same step saved before (a run resumed from an older checkpoint)
        _remove(final)
    os.rename(tmp, final)
    _fsync(base)
    old, newer = stale(base, step, keep)
    for k in old:
        _remove(os.path.join(base, f"step_{k}"))
    for k in newer:  # kept, out of `latest`'s way
        os.rename(os.path.join(base, f"step_{k}"), os.path.join(base, f"abandoned_step_{k}"))
    return final


def _remove(path: str) -> None:
    """Renamed to a temp dir first, then removed: a kill in the middle of the removal leaves a `.tmp-` dir, which the
    next `begin` removes, never a `step_<k>` that has lost its COMPLETE (never counted again, so never pruned)."""
    doomed = os.path.join(os.path.dirname(path), f".tmp-old-{os.path.basename(path)}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def stale(base: str, step: int, keep: int) -> tuple[list[int], list[int]]:
    """Once `step_<step>` is committed: the complete checkpoints in `base` to remove (older than the `keep` newest by
    step number, step_9 before step_10; `keep` <= 0: none), and those newer than it, to set aside as
    `abandoned_step_<k>`. A newer one is of a history this run left by resuming from an older checkpoint: left as it
    is, `latest` (resume=auto) would pick it over this run's; removed, a user's work would be lost. Dirs without
    COMPLETE are never loaded and never counted or touched here."""
    done = sorted(int(m.group(1)) for d in os.listdir(base) if (m := re.fullmatch(r"step_(\d+)", d))
                  and os.path.exists(os.path.join(base, d, MARKER)))
    older = [s for s in done if s < step]
    remove = older[: max(0, len(older) - (keep - 1))] if keep > 0 else []
    return remove, [s for s in done if s > step]


def due(step: int, total_steps: int, save_freq: int, save_interval_s: float, since_save_s: float) -> bool:
    """Whether to checkpoint after `step`: at the end, every `save_freq` steps, and once `save_interval_s` seconds
    have passed since the last save (or the run's start) — so a crash loses at most save_freq steps or
    save_interval_s seconds plus one step. 0 turns either off."""
    return (step == total_steps or (save_freq > 0 and step % save_freq == 0)
            or (save_interval_s > 0 and since_save_s >= save_interval_s))


def preflight(output_dir: str, n: int, dtype: str, export_hf: bool) -> None:
    """`room` for the job's model of `n` parameters (rayrl.models.param_count), the warning printed."""
    warning = room(output_dir, n, n * (4 if dtype == "float32" else 2) if export_hf else 0)
    if warning:
        print(warning, file=sys.stderr)  # noqa: T201


def room(output_dir: str, n_params: int, export_bytes: int, free: int | None = None) -> str | None:
    """Before anything starts: raises ConfigError when the disk of `output_dir` cannot hold one checkpoint
    of a model with `n_params` parameters plus the Hugging Face export (`export_bytes`; 0 = none): the run's first
    save would fail after the training it was meant to keep (a 4B run filled a 64 GB disk that way). Returns a
    warning line when it holds one but not KEEP + 1 (the newest ones kept, and the one being written), else None.
    `free`: the free bytes (default: the disk's, of output_dir or its nearest existing parent)."""
    if free is None:
        where = os.path.abspath(output_dir)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        free = shutil.disk_usage(where).free
    one = n_params * BYTES_PER_PARAM
    gb = 1e9
    need = (f"one checkpoint of this {n_params / 1e9:.2f}B-parameter model needs ~{one / gb:.1f} GB "
            "(fp32 weights and AdamW state)")
    if free < one + export_bytes:
        raise ConfigError(
            f"trainer.output_dir {output_dir!r}: {free / gb:.1f} GB free on its disk; {need}"
            + (f" and the Hugging Face export ~{export_bytes / gb:.1f} GB" if export_bytes else "")
            + ": point trainer.output_dir at a disk with room")
    if free < (KEEP + 1) * one + export_bytes:
        return (f"rayrl: warning: trainer.output_dir {output_dir!r} has {free / gb:.1f} GB free; {need}, and "
                f"{KEEP + 1} exist at once while a save replaces the oldest of the {KEEP} kept")
    return None


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
