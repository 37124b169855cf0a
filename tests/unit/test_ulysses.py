"""learner.sequence_parallel (rayrl/ulysses.py): two gloo ranks holding half of every packed row each give the same
log-probs, loss, metrics, gradient norm and updated weights as one rank holding all of it; plus the shard() grouping
and the config errors. The two ranks are processes of torch.multiprocessing (no Ray)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from rayrl.config import ConfigError, load_config
from rayrl.types import TrainBatch, Trajectory
from tests.helpers import free_port

# Two micro-batches of two sequences (learner.micro_batch_size=2), each an odd-length row (padded to 2 parts). In the
# first, rank 0's half [0, 10) is all prompt: it holds none of the response positions. Old log-probs are the
# current ones shifted, so the ratio is not 1 and some tokens clip.
PROMPTS = [list(range(20, 32)), [40, 41], [50, 51, 52], [60, 61, 62, 63, 64]]
RESPONSES = [[70], [71, 72, 73, 74], [75, 76, 77, 78, 79], [80, 81]]
BATCH = TrainBatch(prompt_ids=PROMPTS, response_ids=RESPONSES,
                   loss_mask=[[1], [1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 1]],
                   advantages=[[0.5], [-1.0] * 4, [1.5] * 5, [-0.7] * 2], global_tokens=10, global_seqs=4)
SHIFT = [[0.3], [-0.4, 0.1, 0.0, 0.25], [0.05, -0.3, 0.5, -0.1, 0.0], [0.2, -0.35]]


def run(model: str, overrides: list[str], rank: int, world: int, port: int) -> dict:
    """One learner rank: log-probs, a step with shifted old log-probs, an on-policy step (the KL to the reference is
    no longer 0), the gradients each step applied, the updated weights (rank 0) and log-probs."""
    from rayrl.learner import Learner

    cfg = load_config(None, ["learner.lr=1e-2", "learner.micro_batch_size=2", f"learner.num_workers={world}",
                             *overrides], check_files=False)
    ln = Learner(model, cfg, rank, world)
    ln.setup("127.0.0.1", port)
    grads, optimizer_step = [], ln.optim.step

    def recording_step(*args, **kwargs):  # torch's step, after noting the gradients (full_tensor: a collective)
        grads.append({n: p.grad.full_tensor().cpu().numpy().copy() for n, p in ln.model.named_parameters()})
        return optimizer_step(*args, **kwargs)

    ln.optim.step = recording_step
    try:
        before = ln.compute_logprobs(BATCH)
        old = [[a + b for a, b in zip(lp, s, strict=True)] for lp, s in zip(before, SHIFT, strict=True)]
        stats = [ln.train_step(BATCH, old), ln.train_step(BATCH)]
        packet = ln.send_weights("object_store", 2)
        return {"before": before, "after": ln.compute_logprobs(BATCH), "stats": stats, "grads": grads,
                "weights": None if packet is None else packet.arrays}
    finally:
        ln.shutdown()


def _spawned(rank: int, model: str, overrides: list[str], world: int, port: int, out: str) -> None:
    import torch

    if torch.cuda.device_count() >= world:  # tests/gpu: GPU learners, one GPU per rank
        torch.cuda.set_device(rank)
    result = run(model, overrides, rank, world, port)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(result, f)


def sequence_parallel(model: str, overrides: list[str], tmp_path) -> list[dict]:
    """Two ranks of one sequence-parallel group, each in a process of its own: their `run` results."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.spawn(_spawned, args=(model, [*overrides, "learner.sequence_parallel=2"], 2, free_port(), out), nprocs=2)
    results = []
    for r in range(2):
        with open(f"{out}.{r}", "rb") as f:
            results.append(pickle.load(f))
    return results


@pytest.fixture(scope="module")
def mqa_model(tiny_model, tmp_path_factory) -> str:
    """The tiny Qwen2 with one key/value head: fewer kv heads than sequence-parallel ranks (repeated to 2)."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model)
    cfg.num_key_value_heads = 1
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("models") / "tiny-mqa")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize(("which", "overrides"), [
    ("tiny_model", ["algo.entropy_coeff=0.01", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.5"]),
    ("mqa_model", ["algo.loss_agg_mode=seq-mean-token-mean", "rollout.temperature=0.7"]),
    # checkpointed layers that keep the attention's outputs: the all-to-all around it recomputed, the kernel not
    ("tiny_model", ["model.gradient_checkpointing=true", "model.gradient_checkpointing_keep_attention=true"]),
])
def test_two_ranks_equal_one(which, overrides, request, tmp_path):
    model = request.getfixturevalue(which)
    assert_equal_runs(run(model, overrides, 0, 1, free_port()), sequence_parallel(model, overrides, tmp_path),
                      overrides)


def assert_equal_runs(one: dict, sp: list[dict], overrides: list[str], atol: float = 2e-5, rel: float = 1e-4,
                      grad_rel: tuple[float, float] = (1e-5, 1e-3), weight_atol: float | None = 2e-3) -> None:
    """The sequence-parallel ranks' log-probs, step statistics, gradients and updated weights are the single rank's.
    The first step's gradients agree to float32 rounding (`grad_rel[0]`, relative norm of the difference per
    parameter). After it AdamW divides each gradient by its running RMS, so rounding in a near-zero gradient moves a
    weight by a sizeable part of lr (1e-2): the second step's gradients and the weights get looser bounds (None: the
    weights are not compared)."""
    for r in sp:
        for key in ("before", "after"):
            assert [len(x) for x in r[key]] == [len(x) for x in RESPONSES]
            np.testing.assert_allclose(np.concatenate(r[key]), np.concatenate(one[key]), rtol=0, atol=atol)
    for step, want in enumerate(one["stats"]):
        for r in sp:
            assert r["stats"][step].grad_norm == pytest.approx(want.grad_norm, rel=rel)
        # the driver sums the ranks' shares: each rank of the group reports half of the shard's values
        for key in ("loss", "entropy", "pg_clipfrac", "ppo_kl"):
            got = sum(getattr(r["stats"][step], key) for r in sp)
            assert got == pytest.approx(getattr(want, key), rel=rel, abs=1e-6), (step, key)
        if "algo.use_kl_loss=true" in overrides:
            got = sum(r["stats"][step].extra["kl_loss"] for r in sp)
            assert got == pytest.approx(want.extra["kl_loss"], rel=rel, abs=1e-9), step
    assert one["stats"][0].pg_clipfrac > 0  # the shifted old log-probs clip some tokens: the clip path is compared
    assert "algo.use_kl_loss=true" not in overrides or one["stats"][1].extra["kl_loss"] > 0
    assert one["after"] != one["before"]  # the steps changed the policy, so "after" compares the updates
    assert not sp[1]["weights"]  # the full state is gathered on rank 0
    assert sorted(sp[0]["weights"]) == sorted(one["weights"])
    for step, tol in enumerate(grad_rel):
        for r in sp:
            for name, g in one["grads"][step].items():
                diff = np.linalg.norm(r["grads"][step][name] - g) / max(np.linalg.norm(g), 1e-30)
                assert diff < tol, (step, name, diff)
    for name, w in one["weights"].items() if weight_atol is not None else ():
        np.testing.assert_allclose(sp[0]["weights"][name], w, rtol=0, atol=weight_atol, err_msg=name)


def test_shard_gives_each_group_of_k_ranks_one_shard():
    from rayrl.batching import shard

    trajs = [Trajectory(task_id=f"g{g}/{i}", group_id=f"g{g}", step=1, data_source="t", prompt_ids=[1, 2],
                        response_ids=[3] * (i + 1 + g), loss_mask=[1] * (i + 1 + g), reward=float(i))
             for g in range(2) for i in range(3)]
    groups = [trajs[:3], trajs[3:]]
    advs = [[0.0] * len(t.response_ids) for t in trajs]
    plain, grouped = shard(groups, advs, 2), shard(groups, advs, 4, sequence_parallel=2)
    assert [b.response_ids for b in grouped] == [plain[0].response_ids] * 2 + [plain[1].response_ids] * 2
    assert all(b.global_tokens == plain[0].global_tokens for b in grouped)


@pytest.mark.parametrize(("overrides", "message"), [
    (["learner.num_workers=3", "learner.sequence_parallel=2"],
     "learner.num_workers (3) must be divisible by learner.sequence_parallel (2)"),
    (["learner.num_workers=2", "learner.sequence_parallel=2", "learner.pack=false"],
     "learner.sequence_parallel=2 needs learner.pack=true"),
    (["learner.num_workers=4", "learner.sequence_parallel=2", "trainer.batch_size=3", "rollout.n=3"],
     "learner.num_workers / learner.sequence_parallel (4 / 2 = 2)"),
    (["learner.sequence_parallel=0"], "learner.num_workers (1) must be divisible by learner.sequence_parallel (0)"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides, check_files=False)


def test_config_checks_the_model_heads(tiny_model):
    """The tiny Qwen2 has 4 attention heads and 2 kv heads: 4-way splits them (kv heads repeated), 3-way cannot."""
    load_config(None, [f"model.path={tiny_model}", "learner.num_workers=4", "learner.sequence_parallel=4"])
    with pytest.raises(ConfigError, match=r"4 attention heads are not divisible by learner.sequence_parallel \(3\)"):
        load_config(None, [f"model.path={tiny_model}", "learner.num_workers=3", "learner.sequence_parallel=3",
                           "rollout.n=3"])
