"""The process test_checkpoint_crash.py SIGKILLs: it trains the plain Learner (world size 1) and saves a checkpoint
after every step as rayrl.train does (checkpoint.begin, Learner.save, checkpoint.commit). Before each save it writes
a fingerprint of what the checkpoint must hold (model, optimizer, RNGs, data position); on start it resumes from
checkpoint.latest and exits 3 unless what it loaded has that fingerprint bit for bit.

`python tests/integration/ckpt_child.py OUT_DIR MODEL TOTAL_STEPS`; prints `resumed K {data}`, `saving K`,
`committed K`, one per line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys

ROWS, BATCH = 8, 4  # two steps per epoch: every other save is at an epoch boundary


def fingerprint(ln, data) -> dict[str, str]:
    """sha256 of every tensor's bytes (model, optimizer state) and of the RNG states; the data position as is."""
    import numpy as np
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, str] = {}

    def add(key: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                add(f"{key}/{k}", x)
        elif isinstance(v, torch.Tensor):
            t = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().reshape(-1).contiguous()
            out[key] = f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        else:
            out[key] = repr(v)

    model, optim = get_state_dict(ln.model, ln.optim)
    add("model", model)
    add("optim", optim)
    add("rng/torch", torch.get_rng_state())
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["rng/numpy"] = hashlib.sha256(keys.tobytes()).hexdigest() + f":{name}:{pos}:{has_gauss}:{cached}"
    out["rng/python"] = hashlib.sha256(repr(random.getstate()).encode()).hexdigest()
    out["data"] = json.dumps(data.state(), sort_keys=True)
    return out


def say(line: str) -> None:
    print(line, flush=True)  # noqa: T201 - the test reads these lines as they happen


def main(out: str, model_path: str, total: int) -> int:
    import numpy as np
    import torch

    from rayrl import checkpoint
    from rayrl.config import load_config
    from rayrl.data import DataIterator
    from rayrl.learner import Learner
    from rayrl.types import TrainBatch

    ln = Learner(model_path, load_config(None, ["learner.lr=1e-2"], check_files=False))
    ln.setup()
    data = DataIterator(list(range(ROWS)), BATCH, seed=1)
    step = 0
    ckpt = checkpoint.latest(out)
    if ckpt is not None:  # what rayrl.train.resume does
        state = checkpoint.load_state(ckpt)
        ln.load(ckpt)
        data.load_state(state["data"])
        random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python_rng"]))
        step = state["step"]
        with open(os.path.join(out, "ref", f"step_{step}.json")) as f:
            want = json.load(f)
        got = fingerprint(ln, data)
        if got != want:
            bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            say(f"mismatch at step {step}: {len(bad)} entries differ: {bad[:8]}")
            return 3
        say(f"resumed {step} {json.dumps(state['data'], sort_keys=True)}")
    os.makedirs(os.path.join(out, "ref"), exist_ok=True)
    while step < total:
        rows = data.next_batch()
        n = len(rows)
        ln.train_step(TrainBatch(prompt_ids=[[1 + r, 2, 3] for r in rows], response_ids=[[8, 9 + r % 3] for r in rows],
                                 loss_mask=[[1, 1]] * n, advantages=[[(-1.0) ** r] * 2 for r in rows],
                                 global_tokens=2 * n, global_seqs=n))
        torch.rand(3), np.random.rand(), random.random()  # every RNG moves each step
        step += 1
        ref = os.path.join(out, "ref", f"step_{step}.json")
        with open(ref + ".tmp", "w") as f:
            json.dump(fingerprint(ln, data), f)
        os.replace(ref + ".tmp", ref)
        say(f"saving {step}")
        tmp = checkpoint.begin(out, step)
        ln.save(tmp)
        checkpoint.commit(tmp, step, {"step": step, "policy_version": step, "data": data.state(),
                                      "python_rng": random.getstate()})
        say(f"committed {step}")
    ln.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
