"""Log-probs and entropy of the sampled tokens, from [N, V] logits or — the lm_head fused — from [N, H] hidden states
and the head's weight, without an [N, V] tensor held for autograd (fused: without one at all).

`_TokenLogprobs` walks the rows `chunk` at a time (forward and backward); each chunk's arithmetic is one of the
`_Kernels` below, eager or torch.compile'd; fused, each chunk's logits are one GEMM before it, and its gradient two
GEMMs after it. `LogprobHead` puts the fused path inside a transformers model, in place of its lm_head. Plain torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

LOGPROB_CHUNK = 4096  # rows of fp32 [rows, vocab] at a time (2.5 GB for a 151k vocabulary)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, compiled: bool = False,
                   chunk: int = LOGPROB_CHUNK) -> torch.Tensor:
    """log_softmax(logits / temperature)[n, targets[n]] in fp32 for [N, V] logits of any dtype.

    Same values as `(logits.float() / t).log_softmax(-1).gather(...)`, but the fp32 copy exists `chunk` rows at a
    time, in backward too (which recomputes the softmax), instead of [N, V] fp32 held for autograd.
    `compiled`: each chunk's arithmetic is one torch.compile'd function: the forward one reduction kernel, the
    backward one pointwise kernel that reads the logits once and writes the gradient in their dtype straight into
    its rows of the result (no fp32 [rows, V] intermediate, no scatter, no copy)."""
    return _TokenLogprobs.apply(logits, None, targets, temperature, _kernels(compiled), False, chunk)


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           compiled: bool = False, chunk: int = LOGPROB_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and, from the same chunked pass, each row's entropy of softmax(logits / temperature)
    (verl's `entropy_from_logits`: logsumexp(x) - sum(softmax(x) * x)), both fp32 [N]. Backward takes gradients
    through either or both; with none reaching the entropy it is exactly `token_logprobs`' backward."""
    return _TokenLogprobs.apply(logits, None, targets, temperature, _kernels(compiled), True, chunk)


def hidden_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    compiled: bool = False, entropy: bool = False, chunk: int = LOGPROB_CHUNK):
    """`token_logprobs` (with `entropy`: `token_logprobs_entropy`) of the logits `hidden @ weight.T`, the lm_head
    projection fused into the chunk loop: [N, H] hidden states and the [V, H] head weight in, no [N, V] tensor kept
    (peak extra memory one [chunk, V] fp32 block), gradients into both."""
    return _TokenLogprobs.apply(hidden, weight, targets, temperature, _kernels(compiled), entropy, chunk)


class LogprobHead(torch.nn.Module):
    """Takes the place of a causal LM's `lm_head` (holding the same `weight` Parameter, so state dicts, tied
    embeddings and FSDP wrapping are unchanged). While `bind`-ed to the targets of a forward, it returns
    [1, N, 1] log-probs (or [1, N, 2] with the entropy) from `hidden_logprobs` in place of [1, N, V] logits;
    unbound it is the plain projection."""

    def __init__(self, head: torch.nn.Linear, compiled: bool = False, chunk: int = LOGPROB_CHUNK):
        super().__init__()
        if getattr(head, "bias", None) is not None:
            raise ValueError("LogprobHead: an lm_head with a bias is not supported")
        self.weight = head.weight
        self.compiled, self.chunk = compiled, chunk
        self.targets: torch.Tensor | None = None
        self.temperature, self.entropy = 1.0, False

    def bind(self, targets: torch.Tensor | None, temperature: float = 1.0, entropy: bool = False) -> None:
        self.targets, self.temperature, self.entropy = targets, temperature, entropy

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return torch.nn.functional.linear(hidden, self.weight)
        out = hidden_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.weight, self.targets, self.temperature,
                              self.compiled, self.entropy, self.chunk)
        # stacked into a new tensor, not a view: FSDP hooks the root's outputs for backward, and warns on views
        return torch.stack([o[None] for o in (out if self.entropy else (out,))], -1)


# --- per-chunk kernels: x = logits / temperature in fp32; d logprob / dx = onehot(target) - p,
# d entropy / dx = -p * (log p + entropy), with p = softmax(x); the gradient w.r.t. the logits is that / temperature.


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    return x.gather(-1, targets[:, None])[:, 0] - lse, lse


def _chunk_forward_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    entropy = lse - (torch.exp(x - lse[:, None]) * x).sum(-1)
    return x.gather(-1, targets[:, None])[:, 0] - lse, lse, entropy


def _chunk_backward(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    grad: torch.Tensor, temperature: float) -> None:
    # eager: an fp32 chunk, then the target column
    d = torch.exp(logits.float() / temperature - lse[:, None]) * -grad[:, None]
    d.scatter_add_(-1, targets[:, None], grad[:, None])
    out.copy_(d / temperature)


def _chunk_backward_entropy(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                            entropy: torch.Tensor, grad: torch.Tensor, grad_entropy: torch.Tensor,
                            temperature: float) -> None:
    logp = logits.float() / temperature - lse[:, None]
    d = torch.exp(logp) * -(grad[:, None] + grad_entropy[:, None] * (logp + entropy[:, None]))
    d.scatter_add_(-1, targets[:, None], grad[:, None])
    out.copy_(d / temperature)


def _fused_backward(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    grad: torch.Tensor, temperature: float) -> None:
    # The same gradient as one elementwise expression (the target column by comparison, not a scatter), which
    # torch.compile turns into one kernel writing `out` in place.
    p = torch.exp(logits.float() / temperature - lse[:, None])
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    out.copy_(torch.where(hit, 1.0 - p, -p) * (grad[:, None] / temperature))


def _fused_backward_entropy(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                            entropy: torch.Tensor, grad: torch.Tensor, grad_entropy: torch.Tensor,
                            temperature: float) -> None:
    logp = logits.float() / temperature - lse[:, None]
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    d = torch.where(hit, grad[:, None], 0.0) - torch.exp(logp) * (grad[:, None]
                                                                  + grad_entropy[:, None] * (logp + entropy[:, None]))
    out.copy_(d / temperature)


@dataclass(frozen=True)
class _Kernels:
    forward: Callable  # (logits, targets, temperature) -> (logprobs, lse)
    forward_entropy: Callable  # (logits, targets, temperature) -> (logprobs, lse, entropy)
    backward: Callable  # (out, logits, targets, lse, grad, temperature) -> None, writes d/dlogits into out
    backward_entropy: Callable  # (out, logits, targets, lse, entropy, grad, grad_entropy, temperature) -> None


@functools.cache
def _kernels(compiled: bool) -> _Kernels:
    if not compiled:
        return _Kernels(_chunk_forward, _chunk_forward_entropy, _chunk_backward, _chunk_backward_entropy)
    return _Kernels(*(_rows_dynamic(torch.compile(k)) for k in (_chunk_forward, _chunk_forward_entropy,
                                                                 _fused_backward, _fused_backward_entropy)))


def _rows_dynamic(kernel):
    """Compile the kernel for any row count but this vocabulary: with every size symbolic (dynamic=True) the
    generated code divides by a runtime vocabulary size for each element and reads unvectorized."""

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.mark_dynamic(a, 0)
        return kernel(*args)

    return call


class _TokenLogprobs(torch.autograd.Function):
    """Outputs logprobs [N], or (logprobs, entropy) with `entropy`, from `x`: [N, V] logits (`weight` None), or [N, H]
    hidden states whose logits are `x @ weight.T`, computed `chunk` rows at a time (the lm_head fused: no [N, V]
    tensor at all). Saves x (and weight), targets, per-row logsumexp (and entropy); backward recomputes each chunk's
    softmax (and, fused, its logits: one more [chunk, H] x [H, V] GEMM) and writes the chunk's gradient into the
    logits' gradient, or through a [chunk, V] buffer into the hidden states' and the weight's gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, targets: torch.Tensor, temperature: float,
                kernels: _Kernels, entropy: bool, chunk: int):
        out = torch.empty(len(targets), dtype=torch.float32, device=x.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if entropy else None
        for s in range(0, len(targets), chunk):
            sl = slice(s, s + chunk)
            logits = x[sl] if weight is None else x[sl] @ weight.t()
            if ent is None:
                out[sl], lse[sl] = kernels.forward(logits, targets[sl], temperature)
            else:
                out[sl], lse[sl], ent[sl] = kernels.forward_entropy(logits, targets[sl], temperature)
        ctx.temperature, ctx.kernels, ctx.chunk, ctx.fused = temperature, kernels, chunk, weight is not None
        ctx.set_materialize_grads(False)  # an output no gradient reaches gets None: no work for it in backward
        saved = (x, weight if weight is not None else x, targets, lse)
        if ent is None:
            ctx.save_for_backward(*saved)
            return out
        ctx.save_for_backward(*saved, ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, grad_entropy: torch.Tensor | None = None):
        x, weight, targets, lse, *ent = ctx.saved_tensors
        none = (None,) * 6
        if grad is None and grad_entropy is None:
            return None, *none
        if grad is None:
            grad = torch.zeros_like(lse)
        if ctx.fused:  # the rows no gradient reaches (loss-masked tokens, sequences of zero advantage) are left out
            # of the recomputed logits and the three GEMMs; their hidden states' gradient is zero (one host sync)
            live = grad != 0 if grad_entropy is None else (grad != 0) | (grad_entropy != 0)
            rows = live.nonzero()[:, 0]
            if len(rows) < len(targets) and len(rows) != 1:  # (one row: a size torch.compile would specialize on)
                grad_live, grad_w = _TokenLogprobs._backward(
                    ctx, x[rows], weight, targets[rows], lse[rows], [e[rows] for e in ent], grad[rows],
                    None if grad_entropy is None else grad_entropy[rows])
                return torch.zeros_like(x).index_copy_(0, rows, grad_live), grad_w, *none[1:]
        grad_x, grad_w = _TokenLogprobs._backward(ctx, x, weight, targets, lse, ent, grad, grad_entropy)
        return grad_x, grad_w, *none[1:]

    @staticmethod
    def _backward(ctx, x, weight, targets, lse, ent, grad, grad_entropy):
        """The chunk loop of backward over the given rows -> (gradient of x, of the weight (fused) or None)."""
        k, t = ctx.kernels, ctx.temperature
        grad_x = torch.empty_like(x)
        if ctx.fused:  # the weight's gradient is summed over chunks in fp32 (no rows: a zero gradient). On CUDA with
            # 16-bit weights, cuBLAS adds each chunk's GEMM into it directly; elsewhere each chunk's GEMM is in the
            # weight's dtype and added after
            into = x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
            zero = into or not len(targets)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if zero else None
            buf = torch.empty(min(ctx.chunk, len(targets)), weight.shape[0], dtype=weight.dtype, device=x.device)
        for s in range(0, len(targets), ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            logits = x[sl] if not ctx.fused else x[sl] @ weight.t()
            d = grad_x[sl] if not ctx.fused else buf[:len(logits)]
            if grad_entropy is None:
                k.backward(d, logits, targets[sl], lse[sl], grad[sl], t)
            else:
                k.backward_entropy(d, logits, targets[sl], lse[sl], ent[0][sl], grad[sl], grad_entropy[sl], t)
            if ctx.fused:
                grad_x[sl] = d @ weight
                if into:
                    torch.addmm(grad_w, d.t(), x[sl], out_dtype=torch.float32, out=grad_w)
                else:
                    part = d.t() @ x[sl]
                    grad_w = part.float() if grad_w is None else grad_w.add_(part)
        return grad_x, None if not ctx.fused else grad_w.to(weight.dtype)
