"""Padding-free packed micro-batches (issue #6): token-budget bins, chunked fp32 log-probs and entropy, and
packed == padded."""

from __future__ import annotations

import random

import pytest
import torch

from rayrl.batching import token_budget_bins
from rayrl.config import load_config
from rayrl.logprobs import token_logprobs, token_logprobs_entropy
from rayrl.types import TrainBatch


def test_bins_respect_the_budget():
    lengths = [5, 30, 7, 12, 3, 9, 20, 1]
    bins = token_budget_bins(lengths, 20)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every sequence exactly once
    assert [1] in bins  # longer than the budget: alone
    assert all(sum(lengths[i] for i in b) <= 20 for b in bins if b != [1])
    # first-fit decreasing: 30 | 20 | 12+7+1 | 9+5+3
    assert sorted(map(sorted, bins)) == [[0, 4, 5], [1], [2, 3, 7], [6]]
    assert token_budget_bins([], 10) == []


def test_bins_split_to_a_minimum_count():
    lengths = [4, 4, 4, 4, 3]
    assert len(token_budget_bins(lengths, 100)) == 1
    bins = token_budget_bins(lengths, 100, min_bins=3)  # another rank needs 3 micro-batches
    assert len(bins) == 3 and sorted(i for b in bins for i in b) == list(range(5))
    assert len(token_budget_bins(lengths, 100, min_bins=9)) == 5  # at most one per sequence


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_match_log_softmax(dtype, compiled):
    torch.manual_seed(0)
    logits = torch.randn(10, 17, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 17, (10,))
    weights = torch.randn(10)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = (ref_logits.float() / 0.7).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (ref * weights).sum().backward()
    # chunk=3: several chunks, the last one short; compiled: the fused one-pass backward
    got = token_logprobs(logits, targets, 0.7, compiled=compiled, chunk=3)
    (got * weights).sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_and_its_gradient_match_float64(dtype, compiled):
    """Entropy from the chunked pass (no [N, V] fp32 held) equals -sum(p log p) of a float64 log_softmax over the
    full logits, and so do the log-probs and the gradients through either output or both."""
    torch.manual_seed(0)
    logits = (torch.randn(10, 17) * 3).to(dtype)
    targets = torch.randint(0, 17, (10,))
    w_lp, w_ent = torch.randn(10), torch.randn(10)
    for lp_weight, ent_weight in ((w_lp, w_ent), (None, w_ent), (w_lp, None)):
        ref_logits = logits.double().requires_grad_(True)
        logp = (ref_logits / 0.7).log_softmax(-1)
        ref_lp, ref_ent = logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
        x = logits.clone().requires_grad_(True)
        lp, ent = token_logprobs_entropy(x, targets, 0.7, compiled=compiled, chunk=3)
        assert lp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp, ref_lp.float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent.float(), atol=1e-5, rtol=0)
        ref_loss, loss = torch.zeros((), dtype=torch.float64), torch.zeros(())
        if lp_weight is not None:
            ref_loss, loss = ref_loss + (ref_lp * lp_weight).sum(), loss + (lp * lp_weight).sum()
        if ent_weight is not None:
            ref_loss, loss = ref_loss + (ref_ent * ent_weight).sum(), loss + (ent * ent_weight).sum()
        ref_loss.backward()
        loss.backward()
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad, ref_logits.grad.to(dtype), atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   rtol=0)


def test_unused_entropy_leaves_the_logprob_gradient_unchanged():
    """With no gradient reaching the entropy (algo.entropy_coeff 0), the backward is token_logprobs' own: the same
    gradient, bit for bit."""
    torch.manual_seed(0)
    logits = torch.randn(10, 17)
    targets, w = torch.randint(0, 17, (10,)), torch.randn(10)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    (token_logprobs(a, targets, 0.7, chunk=3) * w).sum().backward()
    lp, _ = token_logprobs_entropy(b, targets, 0.7, chunk=3)
    (lp * w).sum().backward()
    assert torch.equal(a.grad, b.grad)


def _batch() -> TrainBatch:
    rng = random.Random(0)
    shapes = [(3, 9), (17, 2), (1, 12), (8, 8), (25, 1), (5, 14)]  # prompt, response lengths
    prompts = [[rng.randrange(10, 300) for _ in range(p)] for p, _ in shapes]
    resps = [[rng.randrange(10, 300) for _ in range(r)] for _, r in shapes]
    masks = [[int(rng.random() < 0.8) for _ in r] for r in resps]
    advs = [[a] * len(r) for a, r in zip([1.0, -0.5, 0.3, -1.0, 2.0, 0.1], resps, strict=True)]
    return TrainBatch(prompt_ids=prompts, response_ids=resps, loss_mask=masks, advantages=advs,
                      global_tokens=sum(map(sum, masks)), global_seqs=len(shapes))


@pytest.fixture
def make_learner(tiny_model):
    from rayrl.learner import Learner

    made = []

    def make(*overrides: str):
        ln = Learner(tiny_model, load_config(None, ["learner.lr=1e-2", *overrides], check_files=False))
        ln.setup()
        made.append(ln)
        return ln

    yield make
    made[-1].shutdown()  # one process group for all of them


def _grads(ln) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in ln.model.named_parameters()}


def test_packed_equals_padded(make_learner):
    """One packed row (positions restarting per sequence) gives the padded log-probs, loss and gradients, with
    sequences of different lengths, counted micro-batches or a token budget, and for the KL reference model."""
    batch = _batch()
    kl = ["algo.use_kl_loss=true", "algo.kl_loss_coef=0.5"]
    padded = make_learner("learner.pack=false", "learner.micro_batch_size=4", *kl)
    runs = {name: make_learner(*o, *kl) for name, o in {
        "packed": ["learner.micro_batch_size=4"],
        "budget": ["learner.max_tokens_per_micro_batch=40"]}.items()}
    assert len(runs["budget"]._micro_batches(batch)) > 2  # the budget really splits the batch
    want = padded.compute_logprobs(batch)
    assert [len(x) for x in want] == [len(r) for r in batch.response_ids]
    for ln in runs.values():
        got = ln.compute_logprobs(batch)
        for w, g in zip(want, got, strict=True):
            assert g == pytest.approx(w, abs=1e-5)
        # The reference model's packed forward must not see the other sequences either
        ref = ln._logprobs(batch, list(range(len(batch))), model=ln.ref)[0]
        for j, w in enumerate(want):
            assert ref[j, : len(w)].tolist() == pytest.approx(w, abs=1e-5)
    # off-policy: old log-probs shifted so the ratio and the KL term are not trivial
    old = [[x + 0.1 * ((i + k) % 3 - 1) for k, x in enumerate(w)] for i, w in enumerate(want)]
    base = padded.train_step(batch, old)
    base_grads = _grads(padded)
    for ln in runs.values():
        stats = ln.train_step(batch, old)
        assert stats.loss == pytest.approx(base.loss, abs=1e-6)
        assert stats.ppo_kl == pytest.approx(base.ppo_kl, abs=1e-6)
        assert stats.entropy == pytest.approx(base.entropy, abs=1e-6) and base.entropy > 0
        for n, g in _grads(ln).items():
            torch.testing.assert_close(g, base_grads[n], atol=1e-6, rtol=1e-4, msg=n)


def test_one_rank_accumulates_gradients_like_per_micro_batch_reduction(make_learner, monkeypatch):
    """One rank keeps its bf16 weights gathered and sums the micro-batches' gradients in fp32 (FSDP2 no-sync),
    reducing once: the same fp32 gradients as reducing after every micro-batch, bf16 compute included."""
    batch = _batch()
    fast = make_learner("model.dtype=bfloat16", "learner.max_tokens_per_micro_batch=40")
    assert len(fast._micro_batches(batch)) > 2
    calls = []
    real = fast._accumulate_locally
    monkeypatch.setattr(fast, "_accumulate_locally", lambda more: (calls.append(more), real(more)))
    grads = {}  # each learner's gradients as its optimizer step sees them (train_step frees them afterwards)

    def record(ln, name):
        step = ln.optim.step
        monkeypatch.setattr(ln.optim, "step", lambda *a, **k: (grads.__setitem__(name, _grads(ln)), step(*a, **k)))

    record(fast, "fast")
    stats = fast.train_step(batch)
    assert calls == [True] * (len(calls) - 1) + [False]  # sums while more follow, reduces at the last
    plain = make_learner("model.dtype=bfloat16", "learner.max_tokens_per_micro_batch=40")
    monkeypatch.setattr(plain, "_accumulate_locally", lambda more: None)  # reduce after every micro-batch
    record(plain, "plain")
    base = plain.train_step(batch)
    assert stats.loss == pytest.approx(base.loss, abs=1e-6)
    want = grads["plain"]
    assert want and set(want) == set(grads["fast"])
    for n, g in grads["fast"].items():
        assert g.dtype == torch.float32, n
        torch.testing.assert_close(g, want[n], atol=1e-6, rtol=1e-5, msg=n)
    # the next step re-gathers the updated weights: both learners still agree after their optimizer steps
    assert fast.compute_logprobs(batch) == plain.compute_logprobs(batch)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_head_matches_float64_projection(compiled):
    """The lm_head fused into the chunked kernel: log-probs, entropy and the gradients into the hidden states AND
    the head weight equal log_softmax over the full float64 logits, across several chunks."""
    from rayrl.logprobs import hidden_logprobs

    g = torch.Generator().manual_seed(3)
    n, h, v, temp = 23, 16, 61, 0.7
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent = hidden_logprobs(hidden, weight, targets, temp, compiled=compiled, entropy=True, chunk=7)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ls = ((hd @ wd.t()) / temp).log_softmax(-1)
    ref_lp, ref_ent = ls.gather(-1, targets[:, None])[:, 0], -(ls.exp() * ls).sum(-1)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-4)
    assert torch.allclose(hidden.grad.double(), hd.grad, atol=1e-4)
    assert torch.allclose(weight.grad.double(), wd.grad, atol=1e-4)


@pytest.mark.parametrize("entropy", [False, True])
def test_fused_head_backward_leaves_out_the_rows_no_gradient_reaches(entropy):
    """Rows whose log-prob (and entropy) gradient is zero (loss-masked tokens, zero-advantage sequences) get a zero
    hidden-state gradient without their logits being recomputed: the backward kernel sees the live rows only, and
    the gradients equal the float64 reference."""
    from rayrl import logprobs

    g = torch.Generator().manual_seed(5)
    n, h, v = 19, 8, 37
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    w_lp = torch.randn(n, generator=g) * (torch.arange(n) % 3 != 0)  # every third row dead
    w_ent = w_lp.flip(0) if entropy else torch.zeros(n)  # with the entropy, a row is live if either reaches it
    seen = []
    k = logprobs._kernels(False)

    def backward(out, logits, *rest):
        seen.append(len(logits))
        return (k.backward_entropy if entropy else k.backward)(out, logits, *rest)

    kernels = logprobs._Kernels(k.forward, k.forward_entropy, backward, backward)
    out = logprobs._TokenLogprobs.apply(hidden, weight, targets, 1.0, kernels, entropy, 4)
    lp, ent = out if entropy else (out, None)
    ((lp * w_lp).sum() + (0 if ent is None else (ent * w_ent).sum())).backward()
    live = int(((w_lp != 0) | (w_ent != 0)).sum())
    assert live < n and sum(seen) == live and max(seen) == 4
    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ls = (hd @ wd.t()).log_softmax(-1)
    ref = (ls.gather(-1, targets[:, None])[:, 0] * w_lp).sum() + (-(ls.exp() * ls).sum(-1) * w_ent).sum()
    ref.backward()
    assert torch.allclose(hidden.grad.double(), hd.grad, atol=1e-5)
    assert torch.allclose(weight.grad.double(), wd.grad, atol=1e-5)
    assert torch.equal(hidden.grad[(w_lp == 0) & (w_ent == 0)], torch.zeros(n - live, h))


def test_logprob_head_keeps_the_parameter_and_is_plain_when_unbound():
    from rayrl.logprobs import LogprobHead

    lin = torch.nn.Linear(8, 30, bias=False)
    head = LogprobHead(lin, chunk=4)
    assert head.weight is lin.weight and list(dict(head.named_parameters())) == ["weight"]
    x = torch.randn(1, 5, 8)
    assert torch.equal(head(x), lin(x))  # unbound: the projection
    targets = torch.randint(0, 30, (5,))
    head.bind(targets, 1.0, entropy=True)
    out = head(x)
    assert out.shape == (1, 5, 2)
    assert torch.allclose(out[0, :, 0], lin(x)[0].log_softmax(-1).gather(-1, targets[:, None])[:, 0], atol=1e-6)


def test_fused_head_backward_on_no_rows():
    """An empty chunk of positions (a rank whose share holds no response token) gives zero gradients, not a crash."""
    from rayrl.logprobs import hidden_logprobs

    hidden = torch.randn(0, 8).requires_grad_()
    weight = torch.randn(11, 8).requires_grad_()
    lp = hidden_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), 1.0, compiled=False)
    lp.sum().backward()
    assert hidden.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros(11, 8))
