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
        engines = [Probe.options(num_cpus=1, num_gpus=e.gpus_per_engine, **cluster.engine_placement(cfg, groups, i))
                   .remote() for i in range(e.num_engines)]
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


@pytest.mark.parametrize("engines, ranks, gpus", [(2, 1, 1), (4, 2, 2), (3, 2, 2), (3, 1, 3)])
def test_colocated_engines_share_their_ranks_gpu_when_they_fit(four_gpus, engines, ranks, gpus):
    """Engines of 0.2 GPU beside ranks of 0.5: two fit on each rank's GPU (the one-GPU job with two engines); three
    beside one rank do not (0.6 + 0.5): then engine i is paired with GPU i, as with one engine a rank."""
    cfg = load_config(None, [f"engine.num_engines={engines}", "engine.gpus_per_engine=0.2",
                             f"learner.num_workers={ranks}", "learner.gpus_per_worker=0.5"], check_files=False)
    assert cluster.colocated(cfg) and cluster.gpu_bundles(cfg) == gpus
    placed, learners, mode = _place(cfg)
    assert len({g[0] for g in placed + learners}) == gpus
    if gpus == ranks:  # every engine on the GPU of the rank it loads from
        assert [placed[i] for i in range(engines)] == [learners[i % ranks] for i in range(engines)]
        assert mode == "cuda_ipc"


@ray.remote
class Starting:
    """Stands in for an engine's start: records when it ran."""

    def start(self, after=None):
        import time

        t0 = time.monotonic()
        time.sleep(0.5)
        return t0, time.monotonic()


@pytest.mark.parametrize("overrides, serial, parallel", [
    # engines 0 and 2 on rank 0's GPU, 1 and 3 on rank 1's
    (["engine.num_engines=4", "engine.gpus_per_engine=0.2", "learner.num_workers=2", "learner.gpus_per_worker=0.5"],
     [(0, 2), (1, 3)], [(0, 1), (2, 3)]),
    (["engine.num_engines=2", "engine.gpus_per_engine=1", "learner.gpus_per_worker=1"], [], [(0, 1)]),
    # a fixed KV cache: vLLM does not profile, so engines on one GPU start at once too
    (["engine.num_engines=4", "engine.gpus_per_engine=0.2", "learner.num_workers=2", "learner.gpus_per_worker=0.5",
      "engine.gpu_kv_cache_gb=4"], [], [(0, 2), (1, 3), (0, 1)]),
])
def test_engines_sharing_a_gpu_start_one_after_another(four_gpus, overrides, serial, parallel):
    cfg = load_config(None, overrides, check_files=False)
    spans = ray.get(cluster.start_engines(cfg, [Starting.remote() for _ in range(cfg.engine.num_engines)]),
                    timeout=60)
    for a, b in serial:  # b began after a ended
        assert spans[b][0] >= spans[a][1]
    for a, b in parallel:  # at once
        assert spans[b][0] < spans[a][1] and spans[a][0] < spans[b][1]


def test_separate_gpus_when_not_colocated(four_gpus):
    cfg = load_config(None, ["engine.num_engines=2", "engine.gpus_per_engine=1", "learner.num_workers=2",
                             "learner.gpus_per_worker=1"], check_files=False)
    assert not cluster.colocated(cfg)
    engines, learners, mode = _place(cfg)
    assert len({g[0] for g in engines + learners}) == 4  # 2 engines + 2 learners on 4 different GPUs
    assert mode == "broadcast"
