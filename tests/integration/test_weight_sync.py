"""Weight sync strategies (rayrl/weight_sync/): the flat-buffer layout, choosing a strategy, and the broadcast
strategy end to end over gloo with a real Ray, a real CPU vLLM engine and an FSDP learner."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

from rayrl import weight_sync
from rayrl.weight_sync import cuda_ipc, layout
from rayrl.weight_sync.layout import bucket_nbytes, plan, views

pytestmark = pytest.mark.integration


# --- layout (no Ray) ------------------------------------------------------------------------------------

def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(37, 16, generator=g).to(torch.bfloat16),  # odd sizes: offsets need alignment
            "norm": torch.randn(16, generator=g),
            "scalar": torch.tensor(3.5, dtype=torch.float32),
            "big": torch.randn(300, 300, generator=g).to(torch.bfloat16),  # 180 kB: larger than a bucket below
            "head": torch.randn(5, 7, generator=g).to(torch.float16),
            "ids": torch.arange(11, dtype=torch.int64)}


@pytest.mark.parametrize("bucket_bytes", [None, 4096, 70_000])
def test_layout_views_reconstruct_every_tensor(bucket_bytes):
    ts = _tensors()
    buckets = plan([(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in ts.items()], bucket_bytes)
    assert [s.name for b in buckets for s in b] == list(ts)  # order kept: senders and receivers walk the same list
    for b in buckets:
        buf = torch.zeros(bucket_nbytes(b), dtype=torch.uint8)
        layout.fill(views(buf, b), iter((s.name, ts[s.name]) for s in b))
        for name, v in views(buf, b):  # fresh views of the same bytes, as the receiving side builds them
            assert v.dtype == ts[name].dtype and v.shape == ts[name].shape
            assert torch.equal(v, ts[name]), name
        offsets = [(s.offset, s.offset + s.nbytes) for s in b]
        assert all(o % layout.ALIGN == 0 for o, _ in offsets)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(offsets, offsets[1:], strict=False))  # no overlap
        if bucket_bytes is not None:
            # a bucket respects the size unless one tensor alone is larger than it
            assert bucket_nbytes(b) <= bucket_bytes or len(b) == 1, [s.name for s in b]
    if bucket_bytes is None:
        assert len(buckets) == 1
    if bucket_bytes == 4096:
        assert [s.name for s in buckets[[i for i, b in enumerate(buckets) if b[0].name == "big"][0]]] == ["big"]


def test_layout_rejects_out_of_order_tensors():
    (b,) = plan([("a", (2,), "float32"), ("b", (2,), "float32")])
    buf = torch.zeros(bucket_nbytes(b), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="expected 'a'"):
        layout.fill(views(buf, b), iter([("b", torch.zeros(2)), ("a", torch.zeros(2))]))


def test_auto_picks_by_placement():
    cpu, g0, g1 = ("n1", ()), ("n1", ("0",)), ("n1", ("1",))
    assert weight_sync.resolve("auto", "vllm", [cpu], [cpu]) == "object_store"
    assert weight_sync.resolve("auto", "vllm", [g0], [g0, g0]) == "cuda_ipc"
    assert weight_sync.resolve("auto", "vllm", [g0], [g0, g1]) == "broadcast"
    assert weight_sync.resolve("auto", "vllm", [g0], [("n2", ("0",))]) == "broadcast"  # same index, other node
    assert weight_sync.resolve("auto", "hf", [g0], [g0]) == "object_store"
    assert weight_sync.resolve("broadcast", "vllm", [cpu], [cpu]) == "broadcast"  # an explicit choice stands
    # colocated on several GPUs: engine i on learner rank i's GPU -> each engine loads from its own rank
    assert weight_sync.resolve("auto", "vllm", [g0, g1], [g0, g1]) == "cuda_ipc"
    assert weight_sync.resolve("auto", "vllm", [g0, g1], [g1, g0]) == "broadcast"  # crossed: no shared GPU
    assert [cuda_ipc.serving_rank(i, 2) for i in range(4)] == [0, 1, 0, 1]


def test_config_rejects_unknown_mode_and_hf_with_broadcast():
    from rayrl.config import ConfigError, load_config

    assert load_config(None, [], check_files=False).engine.weight_sync == "auto"  # object_store on CPU
    with pytest.raises(ConfigError, match="engine.weight_sync='nccl' must be one of"):
        load_config(None, ["engine.weight_sync=nccl"], check_files=False)
    with pytest.raises(ConfigError, match="needs engine.backend=vllm"):
        load_config(None, ["engine.backend=hf", "engine.weight_sync=broadcast"], check_files=False)


def test_wait_names_the_actor_on_timeout_and_failure(ray_cluster):
    @ray.remote(num_cpus=0)
    def slow():
        time.sleep(60)

    @ray.remote(num_cpus=0)
    def boom():
        raise ValueError("bad bucket\nsecond line")

    ref = slow.remote()
    with pytest.raises(TimeoutError, match=r"weight sync \(broadcast\): engine/3 did not finish within "
                                           r"engine.sync_timeout=0.5s"):
        weight_sync.wait({"engine/3": ref}, 0.5, "broadcast")
    ray.cancel(ref, force=True)
    with pytest.raises(RuntimeError) as err:
        weight_sync.wait({"engine/1": boom.remote()}, 30, "broadcast")
    assert str(err.value) == "weight sync (broadcast) failed on engine/1: ValueError: bad bucket"


# --- broadcast end to end (Ray, CPU vLLM, gloo) ----------------------------------------------------------

@pytest.mark.parametrize("ranks", [1, 2])
def test_broadcast_sync_engine_matches_learner(tiny_model, ray_cluster, ranks):
    """After an optimizer step and a broadcast sync (gloo, 1 MiB buckets: the tiny model's ~1.7 MB go in
    several, so layers straddle buckets), the engine's greedy logprobs equal the learner's within 1e-4 and differ
    from before the step. A second step + sync reuses the group and its cached layout. With 2 FSDP ranks, both
    gather each full tensor and rank 0 sends."""
    from rayrl.actors.engine import EngineActor
    from rayrl.actors.learner import LearnerActor
    from rayrl.config import load_config
    from rayrl.engine import Sampling
    from rayrl.types import TrainBatch
    from tests.helpers import tiny_overrides

    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "engine.weight_sync": "broadcast", "engine.sync_bucket_mb": 1, "engine.sync_timeout": 120}))
    engine = EngineActor.options(num_cpus=1, max_concurrency=100).remote(tiny_model, cfg.engine, cfg.model.dtype, 0,
                                                                          "engine/0")
    learners = [LearnerActor.options(num_cpus=1).remote(tiny_model, cfg, r, ranks) for r in range(ranks)]
    prompt = [5, 17, 33, 2, 90, 41, 7]
    greedy = Sampling(max_tokens=12, temperature=0.0)
    try:
        addr, port = ray.get(learners[0].address.remote(), timeout=60)
        ray.get([engine.start.remote()] + [ln.setup.remote(addr, port) for ln in learners], timeout=600)
        mode = weight_sync.connect(cfg, learners, [engine])
        assert mode == "broadcast"
        g0 = ray.get(engine.generate.remote(prompt, greedy), timeout=120)
        for version in (1, 2):
            # every rank trains on the same sequence (its own share of a 2-sequence mini-batch when ranks=2)
            batch = TrainBatch(prompt_ids=[prompt], response_ids=[[11, 12, 13, 14]], loss_mask=[[1, 1, 1, 1]],
                               advantages=[[1.0] * 4], global_tokens=4 * ranks, global_seqs=ranks)
            ray.get([ln.train_step.remote(batch) for ln in learners], timeout=120)
            weight_sync.push(mode, learners, [engine], version, cfg.engine.sync_timeout)
            g1 = ray.get(engine.generate.remote(prompt, greedy), timeout=120)
            assert g1.policy_version == version
            ref = TrainBatch(prompt_ids=[prompt], response_ids=[g1.token_ids], loss_mask=[[1] * len(g1.token_ids)],
                             advantages=[[0.0] * len(g1.token_ids)], global_tokens=1, global_seqs=1)
            lp = ray.get([ln.compute_logprobs.remote(ref) for ln in learners], timeout=120)[0][0]  # FSDP: all ranks
            assert np.allclose(lp, g1.logprobs, atol=1e-4), (version, lp, g1.logprobs)
            assert g1.logprobs != g0.logprobs  # the update reached the engine
            g0 = g1
        # a failure inside the engine worker comes back as one line naming the engine (cuda_ipc cannot open here)
        bogus = cuda_ipc.IpcHandle("x", b"not a handle", [], "no-gpu")
        with pytest.raises(RuntimeError, match=r"^weight sync \(cuda_ipc\) failed on engine/0: "):
            weight_sync.wait({"engine/0": engine.receive_weights.remote("cuda_ipc", bogus, 3)}, 60, "cuda_ipc")
    finally:
        ray.get([engine.shutdown.remote()] + [ln.shutdown.remote() for ln in learners], timeout=60)
        for a in [engine, *learners]:
            ray.kill(a)


def test_copy_all_matches_fill_and_checks_names():
    ts = _tensors()
    (b,) = plan([(k, tuple(v.shape), "bfloat16" if v.is_floating_point() else "int64") for k, v in ts.items()])
    one, two = (torch.zeros(bucket_nbytes(b), dtype=torch.uint8) for _ in range(2))
    layout.fill(views(one, b), iter(ts.items()))
    layout.copy_all(views(two, b), list(ts.items()))  # casting fp32/fp16 -> bf16 in the same fused copy
    assert torch.equal(one, two)
    with pytest.raises(RuntimeError, match="expected 'embed', the model gave 'norm'"):
        layout.copy_all(views(two, b), list(ts.items())[1:])
    with pytest.raises(RuntimeError, match="expected 'ids', the model gave None"):  # a tensor missing at the end
        layout.copy_all(views(two, b), list(ts.items())[:-1])


class _FusedModel(torch.nn.Module):
    """vLLM's layout of a Qwen2/Llama layer: q/k/v and gate/up stacked into one parameter each."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 8)  # q: 4 rows, k: 2, v: 2
        self.gate_up_proj = torch.nn.Linear(4, 6, bias=False)
        self.norm = torch.nn.Parameter(torch.zeros(4))
        self.embed = torch.nn.Parameter(torch.randn(8, 4))  # 5 vocabulary rows padded to 8, as vLLM pads to 64


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4), "q_proj.bias": (4,),
              "k_proj.bias": (2,), "v_proj.bias": (2,), "gate_proj.weight": (3, 4), "up_proj.weight": (3, 4),
              "norm": (4,), "embed": (5, 4)}
    return [(k, torch.randn(s, generator=g)) for k, s in shapes.items()]


def _load_weights(model, ckpt):  # what vLLM's load_weights does for this layout
    c = dict(ckpt)
    with torch.no_grad():
        for fused, parts in model.packed_modules_mapping.items():
            for kind in ("weight", "bias"):
                p = getattr(getattr(model, fused), kind)
                if p is not None:
                    p.copy_(torch.cat([c[f"{n}.{kind}"] for n in parts]))
        model.norm.copy_(c["norm"])
        model.embed[:5].copy_(c["embed"])
        model.embed[5:].zero_()


def test_direct_copies_replay_load_weights():
    model = _FusedModel()
    first = _checkpoint(0)
    _load_weights(model, first)
    buf = [(k, v.clone()) for k, v in first]  # the engine's persistent views of the learner's buffer
    copies = cuda_ipc.direct_copies(model, buf)
    assert copies is not None and len(copies[0]) == len(first)
    second = _checkpoint(1)
    for (_, view), (_, new) in zip(buf, second, strict=True):  # the learner writes the next weights into its buffer
        view.copy_(new)
    torch._foreach_copy_(*copies)
    expected = _FusedModel()
    _load_weights(expected, second)
    for (name, p), (_, q) in zip(model.named_parameters(), expected.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_direct_copies_refuses_what_is_not_a_plain_copy():
    model = _FusedModel()
    ckpt = _checkpoint(0)
    _load_weights(model, ckpt)
    with torch.no_grad():
        model.norm.mul_(2)  # a load that transforms a weight (e.g. repacking)
    assert cuda_ipc.direct_copies(model, ckpt) is None
    _load_weights(model, ckpt)
    assert cuda_ipc.direct_copies(model, ckpt + [("lm_head.weight", torch.zeros(3, 4))]) is None  # unused source
    half = [(k, v[: v.shape[0] // 2]) if k.startswith("q_proj") else (k, v) for k, v in ckpt]  # a TP shard's shapes
    assert cuda_ipc.direct_copies(model, half) is None
    assert cuda_ipc.direct_copies(model, [kv for kv in ckpt if kv[0] != "up_proj.weight"]) is None  # missing
    with torch.no_grad():
        model.embed[7] = 1.0  # padding rows that load_weights did not zero: not a plain prefix copy
    assert cuda_ipc.direct_copies(model, ckpt) is None
