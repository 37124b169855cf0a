"""Chaos, the long version of tests/chaos: one training run on a head + worker Ray cluster (two `ray start` nodes on
this machine), `--faults` SIGKILLs of the roles in turn (a rollout worker, the RewardActor, a sandbox actor, the
TaskQueue, the Gateway, the engine, and the whole worker node, after which a new one joins; shuffled by `--seed`),
each at a random moment of a step's rollout while episodes are in flight. From the task ids in the run's trace:
tasks issued, trajectories collected, lost and duplicated, and the failed trajectories (an actor's death must never
become one).

    python bench/chaos.py                         # 20 faults, SmolLM2-135M on CPU
    python bench/chaos.py --faults 6 --model /path/to/hf --seed 1
    python bench/chaos.py --faults 12 --model tiny   # the tests' tiny random Qwen2: seconds a step on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rayrl.config import load_config  # noqa: E402
from rayrl.models import make_tiny_model, resolve_model  # noqa: E402
from rayrl.train import train  # noqa: E402
from tests.chaos import roles  # noqa: E402
from tests.helpers import LocalCluster  # noqa: E402

ROLES = ["rayrl/rollout/0", "rayrl/reward/0", "rayrl/sandbox/0", "rayrl/queue", "rayrl/gateway/0", "rayrl/engine/0",
         "node"]
WORKER = {"worker_node": 1}


def newest(name: str) -> str:
    """The live actor of a role: a dead rollout worker's replacement has the next name (rayrl/rollout/0.1, ...)."""
    if name != "rayrl/rollout/0":
        return name
    names = [n for n in ray.util.list_named_actors() if n == name or n.startswith(name + ".")]
    return max(names, key=lambda n: int(n.rpartition(".")[2]) if n != name else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny (the tests' random Qwen2) or a HF folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--out", default=None, help="the run's output_dir (default: a temp dir)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = args.out or tempfile.mkdtemp(prefix="rayrl-chaos-")
    steps = args.faults + 1
    model = make_tiny_model(os.path.join(out, "tiny-qwen2")) if args.model == "tiny" else resolve_model(args.model)
    # head + worker node on this machine: the engine and learner on the head; the rollout worker, RewardActor and
    # sandbox actor on the worker, which a `node` fault kills whole (then a new one joins, as `ray start` would)
    cluster = LocalCluster().start_head(num_cpus=6, resources={"head_node": 1}).add_worker(num_cpus=3,
                                                                                          resources=WORKER)
    os.environ.update({k: v for k, v in cluster.env.items() if k.startswith("RAY_AUTH")})
    ray._raylet.Config.initialize("")  # Ray read its auth settings at import: read them again for this cluster
    ray.init(address=cluster.address, namespace="rayrl-chaos",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "model.path": model, "trainer.output_dir": out, "trainer.total_steps": steps,
        "trainer.batch_size": args.batch_size, "rollout.n": args.n, "trainer.export_hf": False,
        "rollout.max_response_length": 32, "engine.kv_cache_gb": 1, "engine.max_model_len": 512,
        "data.max_prompt_length": 192, "gateway.port": 0, "reward.timeout": 5,
        "rollout.agent": "tests.chaos.roles:agent", "rollout.agent_config": json.dumps({"sleep": 2.0}),
        "reward.fn": "tests.chaos.roles:score", "sandbox.num_actors": 1, "sandbox.cpus_per_actor": 0.5,
        "rollout.infra_retry_delay": 2, "rollout.infra_retries": 6, "trainer.recover_timeout": 300,
        **{f"placement.{role}_resources": "{head_node: 0.01}" for role in ("engine", "learner")},
        **{f"placement.{role}_resources": "{worker_node: 0.01}" for role in ("rollout", "reward", "sandbox")}}.items()])
    plan = [ROLES[k % len(ROLES)] for k in range(args.faults)]  # every role in turn, in a random order
    rng.shuffle(plan)
    killed: list[tuple[str, float]] = []
    errors: list[BaseException] = []

    def chaos() -> None:
        try:
            for k, name in enumerate(plan):
                while not (roles.steps_logged(out) > k and roles.in_flight() >= 1):  # step k + 2's rollout
                    time.sleep(0.2)
                time.sleep(rng.uniform(0.0, 1.0))
                if name == "node":  # every process of the worker node, then a new node joins
                    cluster.kill_worker(len(cluster.workers) - 1)
                    cluster.add_worker(num_cpus=3, resources=WORKER)
                else:
                    roles.kill(newest(name))
                killed.append((name, time.time()))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threading.Thread(target=chaos, daemon=True).start()
    t0 = time.time()
    try:
        summary = train(cfg)
    finally:
        ray.shutdown()
        cluster.stop()
    count = roles.ledger(out, steps, args.batch_size * args.n, args.batch_size)
    per_role = Counter(name for name, _ in killed)
    print(f"\n{'role':<18}{'faults':>7}")
    for name in ROLES:
        print(f"{name:<18}{per_role[name]:>7}")
    print(f"\nsteps {summary.get('step')}/{steps} in {time.time() - t0:.0f}s; faults {len(killed)}/{args.faults}; "
          f"issued {count['issued']} collected {count['collected']} lost {len(count['lost'])} "
          f"duplicated {len(count['duplicated'])} failed {len(count['errors'])}")
    for tid, err in sorted(count["errors"].items()):
        print(f"  failed {tid}: {err}")
    if errors:
        print(f"chaos thread: {errors[0]!r}")
    ok = (not errors and summary.get("step") == steps and not count["lost"] and not count["duplicated"]
          and not count["errors"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
