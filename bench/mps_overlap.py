"""Two processes on one GPU, as a colocated async run has them: a vLLM-like decode loop (a CUDA graph of one token
step for a batch of sequences through a SmolLM2-135M-sized stack of linear layers) and a learner (forward, backward
and AdamW over batches of long rows through the same stack). Each alone, then both at once: once as the GPU runs
them by default (the two CUDA contexts take time slices) and once under NVIDIA MPS, started by placement.mps's own
daemon (`rayrl.mps.MpsDaemon`), where kernels of both run side by side. Prints each one's speed against its own run
alone, in the same call (plain torch and rayrl's source tree: no vLLM or Ray needed on the GPU host).

    python bench/mps_overlap.py [--seconds 12] [--decoders 2]

`--decoders 2` runs two decode processes beside the learner, as the two-engine layout of the async runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rayrl's tree (rayrl.mps: stdlib)


def _stack(torch, hidden: int, inter: int, layers: int):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, 3 * hidden, bias=False), torch.nn.Linear(hidden, hidden, bias=False),
                 torch.nn.Linear(hidden, 2 * inter, bias=False), torch.nn.Linear(inter, hidden, bias=False)]

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(mods)

        def forward(self, x):
            for i in range(0, len(self.layers), 4):
                qkv, o, up, down = self.layers[i : i + 4]
                x = x + o(qkv(x)[..., :hidden])
                g, u = up(x).chunk(2, dim=-1)
                x = x + down(torch.nn.functional.silu(g) * u)
            return x

    return Stack().cuda()


def role(args) -> None:
    """One process: decode or train for `seconds` after `start_at` (a shared wall-clock start), print a JSON line."""
    import torch

    torch.manual_seed(0)
    model = _stack(torch, 576, 1536, 30)
    if args.role == "decode":
        model = model.to(torch.bfloat16).eval()
        x = torch.randn(args.batch, 576, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(3):
                model(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = model(x)

        def step():
            graph.replay()
            y.sum().item()  # the engine reads the sampled tokens back every step
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        x = torch.randn(args.rows, args.tokens, 576, device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
    step()
    while time.time() < args.start_at:
        time.sleep(0.001)
    times, end = [], time.time() + args.seconds
    while time.time() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({"role": args.role, "steps": len(times), "mean_ms": 1e3 * sum(times) / len(times),
                      "p50_ms": 1e3 * times[len(times) // 2], "p90_ms": 1e3 * times[int(len(times) * 0.9)]}),
          flush=True)


def scenario(roles: list[str], args, env: dict | None = None) -> list[dict]:
    """Processes of these roles at once (`env`: MPS clients); each one's JSON line."""
    start_at = time.time() + args.warmup  # CUDA init, model build, graph capture before it
    cmd = [sys.executable, os.path.abspath(__file__), "--seconds", str(args.seconds), "--start-at", str(start_at)]
    procs = [subprocess.Popen(cmd + ["--role", r], stdout=subprocess.PIPE, text=True,
                              env=None if env is None else {**os.environ, **env}) for r in roles]
    return [json.loads(p.communicate(timeout=args.seconds + 120)[0].strip().splitlines()[-1]) for p in procs]


def report(rows: dict, decoders: int) -> None:
    """Each process's speed together against its own alone (same MPS setting), and MPS together against plain."""
    def ms(rs: list[dict], r: str) -> float:  # decode: the median step (summed over decoders); learner: mean step
        return sum(x["p50_ms" if r == "decode" else "mean_ms"] for x in rs if x["role"] == r)

    for pre in ("", "mps_"):
        if pre + "together" not in rows:
            continue
        d0, t0 = rows[pre + "alone_decode"]["p50_ms"], rows[pre + "alone_train"]["mean_ms"]
        d, t = ms(rows[pre + "together"], "decode") / decoders, ms(rows[pre + "together"], "train")
        print(f"{pre or 'plain_'}together ({decoders} decode processes + a learner): decode step p50 {d:.2f} ms "
              f"({d / d0:.2f}x alone: {d0:.2f} ms), learner step {t:.1f} ms ({t / t0:.2f}x alone: {t0:.1f} ms)")
    if "mps_together" in rows:
        d = ms(rows["mps_together"], "decode") / ms(rows["together"], "decode")
        t = ms(rows["mps_together"], "train") / ms(rows["together"], "train")
        print(f"MPS against plain, together: decode step {d:.2f}x, learner step {t:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--warmup", type=float, default=15.0, help="seconds for the processes to start before measuring")
    p.add_argument("--role", choices=["decode", "train"])
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=128, help="sequences in a decode step")
    p.add_argument("--rows", type=int, default=8, help="rows in a learner micro-batch")
    p.add_argument("--tokens", type=int, default=512, help="tokens in a learner row")
    args = p.parse_args()
    if args.role:
        return role(args)
    from rayrl.mps import MpsDaemon  # stdlib only, from the tree put on sys.path above

    together = ["decode"] * args.decoders + ["train"]
    rows = {"alone_decode": scenario(["decode"], args)[0], "alone_train": scenario(["train"], args)[0],
            "together": scenario(together, args)}
    daemon = MpsDaemon(tempfile.mkdtemp(prefix="rayrl-mps-bench-"))
    try:
        rows.update(mps_alone_decode=scenario(["decode"], args, daemon.env)[0],
                    mps_alone_train=scenario(["train"], args, daemon.env)[0],
                    mps_together=scenario(together, args, daemon.env))
    finally:
        daemon.stop()
    print(json.dumps(rows))
    report(rows, args.decoders)
    return None


if __name__ == "__main__":
    main()
