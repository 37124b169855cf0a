"""LearnerWorker: one FSDP2 rank. Logprobs, GRPO loss (verl core_algos via rayrl.algos), optimizer step,
weight streaming to the engines, and sharded checkpoints.

N workers form one process group (gloo on CPU, nccl on GPU); each holds a `fully_shard` shard of
the model and the optimizer state. The driver gives each rank an equal share of every mini-batch.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
import random
import socket
import time

import numpy as np
import ray
import torch
import torch.distributed as dist

from rayrl import algos, attention, weight_sync
from rayrl.config import Config
from rayrl.types import StepStats, TrainBatch
from rayrl.weights import WeightsPacket, pack


class Learner:
    """Plain class (usable without Ray); `LearnerWorker` below is the Ray actor."""

    def __init__(self, model_path: str, cfg: Config, rank: int = 0, world_size: int = 1):
        self.model_path, self.cfg, self.rank, self.world_size = model_path, cfg, rank, world_size
        self.use_cuda = cfg.learner.gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")
        self.compiled = self.use_cuda if cfg.learner.compile is None else cfg.learner.compile
        self._local: list | None = None  # cuda_ipc on one rank: cached views of the parameters (ipc_handle)

    # --- setup -----------------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address (its node IP and a free port)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1", port

    def setup(self, master_addr: str = "127.0.0.1", master_port: int = 0) -> int:
        """Join the process group, load and shard the model, build the optimizer. Returns the parameter count."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():
            if master_port == 0:
                master_addr, master_port = self.address()
            dist.init_process_group("nccl" if self.use_cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.world_size, timeout=datetime.timedelta(minutes=30))
        torch.manual_seed(self.cfg.trainer.seed + self.rank)
        dtype = getattr(torch, self.cfg.model.dtype)
        # Master weights in fp32; bf16 only for compute (mixed precision) when asked. Packed rows on GPU attend
        # through varlen flash attention (rayrl.attention); elsewhere transformers' default (sdpa) masks them.
        flash = dtype in (torch.bfloat16, torch.float16)  # the flash kernel has no fp32; sdpa masks packed rows then
        attn = attention.register() if self.use_cuda and self.cfg.learner.pack and flash else None
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation=attn)
        if model.config.tie_word_embeddings:
            raise ValueError(f"model.path={self.model_path!r} has tied embeddings: engines cannot reload a tied "
                             "lm_head; untie it (see rayrl.models.convert_smollm2)")
        if self.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.to(self.device)
        if self.compiled:  # the forward only: FSDP's hooks around it stay eager (torchtitan does the same)
            for layer in model.model.layers:
                layer.forward = torch.compile(layer.forward, dynamic=LAYER_DYNAMIC)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # Shard each decoder layer, then the root (embeddings, norm, lm_head) — FSDP2's usual wrapping. One rank holds
        # everything anyway: keep the gathered bf16 copy from forward to backward instead of gathering it twice.
        reshard = self.world_size > 1
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
        self.model = model
        self.ref = None
        if self.cfg.algo.use_kl_loss:  # a frozen copy of the initial policy, sharded the same way
            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32,
                                                       attn_implementation=attn).to(self.device).eval()
            ref.requires_grad_(False)
            for layer in ref.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(ref, mp_policy=mp)
            self.ref = ref
        lc = self.cfg.learner
        self.optim = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay,
                                       fused=self.use_cuda)
        return sum(p.numel() for p in model.parameters()) * (self.world_size if self.world_size > 1 else 1)

    # --- training --------------------------------------------------------------------------------

    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        """Indices of `batch`'s sequences, one list per forward/backward: packed by token budget when
        `learner.max_tokens_per_micro_batch` > 0, else `micro_batch_size` sequences in order. Every rank gets
        the same number (FSDP's forward and backward are collectives)."""
        lc = self.cfg.learner
        if lc.max_tokens_per_micro_batch <= 0:
            mb = lc.micro_batch_size
            return [list(range(i, min(i + mb, len(batch)))) for i in range(0, len(batch), mb)]
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        n = len(token_budget_bins(lengths, lc.max_tokens_per_micro_batch))
        if self.world_size > 1:  # the driver gives every rank as many sequences, so every rank can split to the max
            count = torch.tensor([n], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            n = int(count.item())
        return token_budget_bins(lengths, lc.max_tokens_per_micro_batch, min_bins=n)

    def _logprobs(self, batch: TrainBatch, idx: list[int], model=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens of sequences `idx`, with their loss mask and advantages, each
        right-padded to [len(idx), T_resp] (zeros after each response) as rayrl.algos wants them."""
        model = model or self.model
        prompts, resps = [batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx]
        plen, rlen = np.array([len(p) for p in prompts]), np.array([len(r) for r in resps])
        lengths = plen + rlen
        # logits at position t predict token t+1: a response of n tokens after a prompt of p is predicted by [p-1, p+n-1)
        if self.cfg.learner.pack:
            # One row, no padding: positions restart at 0 at each sequence, which transformers reads as packed
            # sequences (block-diagonal causal mask for sdpa/eager, varlen for flash attention).
            ids = np.fromiter(itertools.chain.from_iterable(p + r for p, r in zip(prompts, resps)), np.int64)
            bounds = np.concatenate([[0], np.cumsum(lengths)])  # where each sequence starts, and the end
            keep = np.repeat(bounds[:-1] + plen - 1, rlen) + _aranges(rlen)
            # Sequence boundaries for flash attention's varlen kernel, which otherwise derives them from position_ids
            # in every layer (the other attention implementations ignore them).
            cu = self._dev(bounds, torch.int32)
            varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()),
                      "max_length_k": int(lengths.max())}
            # logits_to_keep: the lm_head runs on the response-predicting positions only, [N_resp, V] not [T, V].
            # use_cache=False: with a KV cache transformers ignores the packing (the reference model keeps use_cache).
            logits = model(input_ids=self._dev(ids[None]), position_ids=self._dev(_aranges(lengths)[None]),
                           logits_to_keep=self._dev(keep), use_cache=False, **varlen).logits[0]
        else:  # right-padded to the longest sequence, full logits (the pre-packing path, kept for comparison)
            ids = np.zeros((len(idx), lengths.max()), dtype=np.int64)
            for j, (p, r) in enumerate(zip(prompts, resps)):
                ids[j, : len(p) + len(r)] = p + r
            attn = (np.arange(lengths.max())[None] < lengths[:, None]).astype(np.int64)
            rows, cols = np.repeat(np.arange(len(idx)), rlen), np.repeat(plen - 1, rlen) + _aranges(rlen)
            logits = model(input_ids=self._dev(ids), attention_mask=self._dev(attn)).logits[self._dev(rows),
                                                                                              self._dev(cols)]
        targets = self._dev(np.fromiter(itertools.chain.from_iterable(resps), np.int64))
        # temperature: the distribution the tokens were sampled from
        lp = token_logprobs(logits, targets, self.cfg.rollout.temperature, compiled=self.compiled)
        t_resp = int(rlen.max())
        where = (self._dev(np.repeat(np.arange(len(idx)), rlen)), self._dev(_aranges(rlen)))
        out = torch.zeros(len(idx), t_resp, device=self.device).index_put(where, lp)
        return (out, self._padded([batch.loss_mask[i] for i in idx], t_resp),
                self._padded([batch.advantages[i] for i in idx], t_resp))

    def _dev(self, array: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host array on the learner's device without waiting for the GPU: through pinned memory, asynchronously.
        (`torch.tensor(..., device="cuda")` copies from pageable memory and then synchronizes the stream: each one
        left the GPU idle while the CPU built the next input, 6% of a step on an H200.)"""
        t = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.use_cuda else t

    def _accumulate_locally(self, more: bool) -> None:
        """One rank holds the whole model: while more micro-batches follow, keep the gathered bf16 weights and add
        this micro-batch's gradients to an fp32 sum (FSDP2's no-sync accumulation) instead of re-gathering the
        weights and "reducing" (copying, casting, adding) every gradient after each backward. The last micro-batch
        reduces and reshards as usual. With several ranks the unsharded sums would cost each rank the full model's
        gradients in fp32, so they reduce every micro-batch."""
        if self.world_size == 1:
            self.model.set_requires_gradient_sync(not more)
            self.model.set_reshard_after_backward(not more)

    def _padded(self, rows: list[list[float]], width: int) -> torch.Tensor:
        out = np.zeros((len(rows), width), dtype=np.float32)
        for j, r in enumerate(rows):
            out[j, : len(r)] = r
        return self._dev(out, torch.float32)

    def _mark(self):
        """A point in the step for the trace's learner spans: on GPU a CUDA event on the stream (no synchronize, so
        the CPU keeps queueing work; `_times` reads them after the step's last sync), elsewhere the wall clock."""
        if not self.use_cuda:
            return time.time()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _times(self, events: list[dict], origin_wall: float, origin) -> None:
        """Turn the events' marks into wall-clock seconds (GPU: the origin's wall time + the GPU time since it)."""
        if not self.use_cuda:
            return
        torch.cuda.synchronize()
        for e in events:
            for key in ("start", "end"):
                e[key] = origin_wall + origin.elapsed_time(e[key]) / 1000

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Current policy's log-probs of every response token (for old-logprob recompute and for tests)."""
        self.model.eval()
        res: list[list[float]] = [[] for _ in range(len(batch))]
        for idx in self._micro_batches(batch):
            lp = self._logprobs(batch, idx)[0].cpu()
            for j, i in enumerate(idx):
                res[i] = lp[j, : len(batch.response_ids[i])].tolist()
        return res

    def train_step(self, batch: TrainBatch, old_logprobs: list[list[float]] | None = None) -> StepStats:
        """One optimizer step on this rank's share of a mini-batch (all ranks call it together).

        `old_logprobs=None` means on-policy (one mini-batch, one epoch, staleness 0): the behaviour policy
        is the current one, so old = current.detach() and the ratio is exactly 1 — the recompute would be
        a second identical forward pass.
        """
        t0, start_wall = time.perf_counter(), time.time()
        start = self._mark()
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        events: list[dict] = []  # forward / backward per micro-batch, then the optimizer step: spans for the trace

        def event(name: str, s: float, e: float, **args) -> None:
            events.append({"name": name, "start": s, "end": e, "rank": self.rank, "args": args})

        micro_batches = self._micro_batches(batch)
        for k, idx in enumerate(micro_batches):
            self._accumulate_locally(k < len(micro_batches) - 1)
            f0 = self._mark()
            lp, mask, adv = self._logprobs(batch, idx)
            old = lp.detach() if old_logprobs is None else self._padded([old_logprobs[i] for i in idx], lp.shape[1])
            # Normalised by mini-batch-wide counts, so summing micro-batches and averaging ranks (FSDP) gives
            # exactly the mini-batch loss (see rayrl.algos).
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(batch, idx, model=self.ref)[0]
            loss, metrics = algos.policy_loss(old, lp, adv, mask, self.cfg.algo, ref_logprobs=ref,
                                              global_token_count=batch.global_tokens,
                                              global_seq_count=batch.global_seqs, dp_size=self.world_size,
                                              loss_scale_factor=self.cfg.rollout.max_response_length)
            f1 = self._mark()
            loss.backward()
            b1 = self._mark()
            tokens = sum(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in idx)
            event("forward", f0, f1, micro_batch=k, sequences=len(idx), tokens=tokens)
            event("backward", f1, b1, micro_batch=k, sequences=len(idx), tokens=tokens)
            # No .item() after backward: the next micro-batch's inputs are built while the GPU still runs this one.
            share = sum(sum(batch.loss_mask[i]) for i in idx) / max(batch.global_tokens, 1)  # its token means' weight
            sums["loss"] = sums.get("loss", 0.0) + loss.detach() / self.world_size
            for key in ("pg_clipfrac", "ppo_kl"):
                sums[key] = sums.get(key, 0.0) + float(metrics[key]) * share
            if "kl_loss" in metrics:  # already this micro-batch's share of the mini-batch value
                sums["kl_loss"] = sums.get("kl_loss", 0.0) + float(metrics["kl_loss"]) / self.world_size
        o0 = self._mark()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.learner.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if np.isfinite(grad_norm):
            self.optim.step()
        else:
            self.optim.zero_grad(set_to_none=True)  # skip a step whose gradients overflowed
        end = self._mark()
        event("optimizer_step", o0, end, grad_norm=grad_norm)
        event("train_step", start, end, sequences=len(batch))
        self._times(events, start_wall, start)  # on GPU: waits for the step to finish (seconds below include it)
        # loss, pg_clipfrac, ppo_kl are this rank's shares of the mini-batch values: the driver sums over ranks
        sums["loss"] = float(sums.get("loss", 0.0))
        return StepStats(loss=sums["loss"], pg_clipfrac=sums.get("pg_clipfrac", 0.0),
                         ppo_kl=sums.get("ppo_kl", 0.0), grad_norm=grad_norm, entropy=0.0,
                         num_tokens=int(sum(sum(m) for m in batch.loss_mask)), seconds=time.perf_counter() - t0,
                         extra={k: v for k, v in sums.items() if k not in ("loss", "pg_clipfrac", "ppo_kl")},
                         events=events)

    # --- weights out -----------------------------------------------------------------------------

    def _full_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Collective: every rank must call. With cpu_offload only rank 0 keeps the gathered tensors.
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def weights(self, version: int) -> WeightsPacket | None:
        """The full state dict at `version`, on rank 0 (None elsewhere), in the engines' dtype."""
        state = self._full_state()
        if self.rank != 0:
            return None
        dtype = getattr(torch, self.cfg.model.dtype)
        return pack({k: v.to(dtype) for k, v in state.items()}, version)

    # The other strategies (rayrl/weight_sync.py) gather one full tensor at a time on the device instead of
    # get_model_state_dict's cpu_offload path: every rank calls, rank 0 copies each tensor where it goes.

    def gpus(self) -> tuple[str, tuple[str, ...]]:
        """(node id, GPU ids) of this rank, for engine.weight_sync=auto."""
        return weight_sync.local_gpus()

    def ipc_handle(self, serve: bool = True) -> weight_sync.IpcHandle | None:
        """cuda_ipc: the full weights copied into this rank's persistent GPU buffer, and its handle, when this rank
        serves an engine on its GPU (`serve`); None otherwise. Every rank must call (the gathers are collectives)."""
        dtype = getattr(torch, self.cfg.model.dtype)
        if self.world_size == 1:  # the whole model is local: copy it in one go from cached views of the parameters
            if self._local is None:  # nothing gathered on one rank: views that follow every optimizer step
                self._local = list(weight_sync.full_tensors(self.model))
            tensors = self._local
        else:
            tensors = weight_sync.full_tensors(self.model)
        if not serve:
            for _ in tensors:  # take part in each all-gather
                pass
            return None
        if getattr(self, "_ipc", None) is None:  # allocated once; the engines keep it open
            self._ipc = weight_sync.IpcSender(self.model, dtype, self.device)
        return self._ipc.update(tensors)

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        """broadcast: rank 0 becomes rank 0 of the learner -> engines group (the engines join at the same time)."""
        e = self.cfg.engine
        self._bcast = weight_sync.BroadcastSender(self.model, getattr(torch, self.cfg.model.dtype), e.sync_bucket_mb << 20,
                                                  host, port, world_size, backend, e.sync_timeout)

    def send_weights(self) -> None:
        """broadcast: every rank gathers each full tensor; rank 0 broadcasts them in buckets."""
        tensors = weight_sync.full_tensors(self.model)
        if self.rank != 0:
            for _ in tensors:
                pass
            return
        if getattr(self, "_bcast", None) is None:
            raise RuntimeError("learner/0: engine.weight_sync=broadcast but the weight group was never joined")
        self._bcast.send(tensors)

    def export_hf(self, out_dir: str) -> str | None:
        """Write the policy as a Hugging Face folder (config, safetensors, tokenizer, chat template)."""
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        state = self._full_state()
        if self.rank != 0:
            return None
        tmp = out_dir + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        AutoConfig.from_pretrained(self.model_path).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(tmp)
        try:
            GenerationConfig.from_pretrained(self.model_path).save_pretrained(tmp)
        except OSError:
            pass  # the base model has none
        _replace_dir(tmp, out_dir)
        return out_dir

    # --- checkpoints -----------------------------------------------------------------------------

    def save(self, ckpt_dir: str) -> None:
        """Sharded model + optimizer (torch.distributed.checkpoint) and this rank's RNG into ckpt_dir."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(ckpt_dir, "learner"))
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if self.use_cuda else None}
        torch.save(rng, os.path.join(ckpt_dir, f"rng_rank{self.rank}.pt"))

    def load(self, ckpt_dir: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._local = None  # the load may replace parameter storage: rebuild the cached views (ipc_handle)
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, "learner"))
        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_path = os.path.join(ckpt_dir, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_path):
            rng = torch.load(rng_path, weights_only=False)
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            if self.use_cuda and rng["cuda"] is not None:
                torch.cuda.set_rng_state_all(rng["cuda"])

    def shutdown(self) -> None:
        if getattr(self, "_bcast", None) is not None:  # the learner -> engines weight group (broadcast)
            self._bcast.close()
            self._bcast = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _aranges(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each n in counts, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def token_budget_bins(lengths: list[int], budget: int, min_bins: int = 0) -> list[list[int]]:
    """Indices of `lengths` grouped so that each group's total is <= `budget` (a longer sequence gets a group of
    its own), first-fit decreasing; then the fullest groups are halved until there are `min_bins` of them (at
    most one per sequence). Indices ascend within a group."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, load in enumerate(loads) if load + lengths[i] <= budget), len(bins))
        if k == len(bins):
            bins.append([])
            loads.append(0)
        bins[k].append(i)
        loads[k] += lengths[i]
    while len(bins) < min(min_bins, len(lengths)):
        k = max((k for k in range(len(bins)) if len(bins[k]) > 1), key=lambda k: loads[k])
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(bins.pop(k), key=lambda i: -lengths[i]):  # longest first, each to the lighter half
            min(halves, key=lambda h: sum(lengths[j] for j in h)).append(i)
        loads.pop(k)
        bins += halves
        loads += [sum(lengths[j] for j in h) for h in halves]
    return [sorted(b) for b in bins]


# learner.compile: torch.compile(dynamic=...) of each decoder layer's forward. None (automatic): the first micro-batch
# compiles for its sizes, the next recompiles with only the sizes that changed (the token count) symbolic; True made
# every size symbolic and the elementwise kernels 1.6x slower on an H200 (0.5B shape).
LAYER_DYNAMIC: bool | None = None
LOGPROB_CHUNK = 4096  # rows of fp32 [rows, vocab] at a time in token_logprobs (2.5 GB for a 151k vocabulary)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   compiled: bool = False) -> torch.Tensor:
    """log_softmax(logits / temperature)[n, targets[n]] in fp32 for [N, V] logits of any dtype.

    Same values as `(logits.float() / t).log_softmax(-1).gather(...)`, but the fp32 copy exists LOGPROB_CHUNK rows
    at a time, in backward too (which recomputes the softmax), instead of [N, V] fp32 held for autograd.
    `compiled`: each chunk's arithmetic is one torch.compile'd function: the forward one reduction kernel, the
    backward one pointwise kernel that reads the logits once and writes the gradient in their dtype straight into
    its rows of the result (no fp32 [rows, V] intermediate, no scatter, no copy)."""
    return _TokenLogprobs.apply(logits, targets, temperature, _kernels(compiled))


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    return x.gather(-1, targets[:, None])[:, 0] - lse, lse


def _chunk_backward(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    grad: torch.Tensor, temperature: float) -> None:
    # d logprob / d scaled logits = onehot(target) - softmax; eager: an fp32 chunk, then the target column
    d = torch.exp(logits.float() / temperature - lse[:, None]) * -grad[:, None]
    d.scatter_add_(-1, targets[:, None], grad[:, None])
    out.copy_(d / temperature)


def _fused_backward(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    grad: torch.Tensor, temperature: float) -> None:
    # The same gradient as one elementwise expression (the target column by comparison, not a scatter), which
    # torch.compile turns into one kernel writing `out` in place.
    p = torch.exp(logits.float() / temperature - lse[:, None])
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    out.copy_(torch.where(hit, 1.0 - p, -p) * (grad[:, None] / temperature))


@functools.cache
def _kernels(compiled: bool):
    if not compiled:
        return _chunk_forward, _chunk_backward
    return _rows_dynamic(torch.compile(_chunk_forward)), _rows_dynamic(torch.compile(_fused_backward))


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
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, kernels) -> torch.Tensor:
        fwd, _ = kernels
        ctx.temperature, ctx.kernels = temperature, kernels
        out = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, len(targets), LOGPROB_CHUNK):
            sl = slice(s, s + LOGPROB_CHUNK)
            out[sl], lse[sl] = fwd(logits[sl], targets[sl], temperature)
        ctx.save_for_backward(logits, targets, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        _, bwd = ctx.kernels
        grad_logits = torch.empty_like(logits)
        for s in range(0, len(targets), LOGPROB_CHUNK):
            sl = slice(s, s + LOGPROB_CHUNK)
            bwd(grad_logits[sl], logits[sl], targets[sl], lse[sl], grad[sl], ctx.temperature)
        return grad_logits, None, None, None


def _replace_dir(tmp: str, final: str) -> None:
    import shutil

    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)


LearnerWorker = ray.remote(Learner)
