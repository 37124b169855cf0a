"""GPU placement by role on a local Ray that declares GPUs it does not have (Ray only counts them): colocated
engines and learners pair up on one GPU per rank; otherwise every engine and learner gets GPUs of its own."""

from __future__ import annotations

import pytest
import ray

from rayrl import cluster, weight_sync
from rayrl.config import load_config

pytestmark = pytest.mark.integration


@ray.remote
class Probe:
    def gpus(self):
        return [str(g) for g in ray.get_gpu_ids()]

    def place(self):
        return weight_sync.local_gpus()


@pytest.fixture(scope="module")
def four_gpus():
    ray.init(num_cpus=16, num_gpus=4, include_dashboard=False, namespace="rayrl-test-placement")
    yield
    ray.shutdown()


def _place(cfg) -> tuple[list[list[str]], list[list[str]], str]:
    """GPU ids of each engine and learner rank as placed, and the weight sync `auto` resolves to for them."""
    groups = cluster.reserve(cfg)
    e, lc = cfg.engine, cfg.learner
    try:
        engines = [Probe.options(num_cpus=1, num_gpus=e.gpus_per_engine, **cluster._in(groups, "engine", i)).remote()
                   for i in range(e.num_engines)]
        learners = [Probe.options(num_cpus=1, num_gpus=lc.gpus_per_worker, **cluster._in(groups, "learner", r)).remote()
                    for r in range(lc.num_workers)]
        places = ray.get([p.place.remote() for p in learners + engines], timeout=120)
        mode = weight_sync.resolve("auto", "vllm", places[:len(learners)], places[len(learners):])
        return (ray.get([p.gpus.remote() for p in engines], timeout=120),
                ray.get([p.gpus.remote() for p in learners], timeout=120), mode)
    finally:
        for g in cluster._unique(groups):
            ray.util.remove_placement_group(g)


def test_colocated_engine_i_shares_learner_rank_is_gpu(four_gpus):
    cfg = load_config(None, ["engine.num_engines=4", "engine.gpus_per_engine=0.4", "learner.num_workers=4",
                             "learner.gpus_per_worker=0.5"], check_files=False)
    assert cluster.colocated(cfg)
    engines, learners, mode = _place(cfg)
    assert all(len(g) == 1 for g in engines + learners)
    assert engines == learners  # engine i on learner rank i's GPU
    assert len({g[0] for g in engines}) == 4  # one pair per GPU
    assert mode == "cuda_ipc"  # each engine loads from its own rank's buffer


def test_separate_gpus_when_not_colocated(four_gpus):
    cfg = load_config(None, ["engine.num_engines=2", "engine.gpus_per_engine=1", "learner.num_workers=2",
                             "learner.gpus_per_worker=1"], check_files=False)
    assert not cluster.colocated(cfg)
    engines, learners, mode = _place(cfg)
    assert len({g[0] for g in engines + learners}) == 4  # 2 engines + 2 learners on 4 different GPUs
    assert mode == "broadcast"
