"""Learner: one FSDP2 rank. Log-probs and entropy (rayrl.logprobs), GRPO loss (verl core_algos via rayrl.algos),
optimizer step, weight streaming to the engines, and sharded checkpoints. `LearnerActor` is its Ray actor.

N workers form one process group (gloo on CPU, nccl on GPU); each holds a `fully_shard` shard of
the model and the optimizer state. The driver gives each rank an equal share of every mini-batch.
"""

from __future__ import annotations

import datetime
import itertools
import os
import random
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from rayrl import algos, attention, offload, recompute, weight_sync
from rayrl.batching import token_budget_bins
from rayrl.config import Config, sequence_parallel_heads_error
from rayrl.export import write_hf
from rayrl.logprobs import LogprobHead, token_logprobs, token_logprobs_entropy
from rayrl.types import StepStats, TrainBatch


class Learner:
    """Plain class (usable without Ray); `LearnerActor` below is the Ray actor.

    `layer_dynamic`: with learner.compile, torch.compile(dynamic=...) of each decoder layer's forward. None (the
    default): the first micro-batch compiles for its sizes, the next recompiles with only the sizes that changed
    (the token count) symbolic; True makes every size symbolic (the elementwise kernels ran 1.6x slower on an H200,
    0.5B shape: bench/gpu compares them)."""

    def __init__(self, model_path: str, cfg: Config, rank: int = 0, world_size: int = 1,
                 layer_dynamic: bool | None = None):
        self.model_path, self.cfg, self.rank, self.world_size = model_path, cfg, rank, world_size
        self.layer_dynamic = layer_dynamic
        self.use_cuda = cfg.learner.gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")
        self.compiled = self.use_cuda if cfg.learner.compile is None else cfg.learner.compile
        rf = cfg.learner.reshard_after_forward
        self.reshard_after_forward = world_size > 1 if rf is None else rf
        self.params_offloaded = False  # learner.param_offload: parameters in CPU memory since the last offload()
        self._writing = None  # trainer.async_save: the background write of the last save (a DCP future)
        self._save_group = None  # the process group of background writes (a CPU backend: gloo)
        # weights out: one sender per strategy (rayrl/weight_sync/), the driver picks which
        self._senders: dict[str, weight_sync.Sender] = {
            name: strategy.Sender(cfg, self.device, world_size) for name, strategy in weight_sync.STRATEGIES.items()}

    # --- setup -----------------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address (its node IP and a free port)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1", port

    def setup(self, master_addr: str = "127.0.0.1", master_port: int = 0) -> int:
        """Join the process group, load and shard the model, build the optimizer. Returns the parameter count."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():
            if master_port == 0:
                master_addr, master_port = self.address()
            dist.init_process_group("nccl" if self.use_cuda else "gloo",
                                    init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(minutes=30))
        if self.cfg.trainer.async_save:  # DCP's background write coordinates ranks on a CPU backend, never on the
            # training's NCCL group from its thread (torchtitan's async checkpoints make the same gloo group)
            self._save_group = dist.new_group(backend="gloo") if self.use_cuda else dist.group.WORLD
        # learner.sequence_parallel: groups of k ranks share a shard, 1/k of each packed row per rank (rayrl.ulysses)
        self.sp, self.sp_size = None, self.cfg.learner.sequence_parallel
        if self.sp_size > 1:
            from rayrl.ulysses import SequenceParallel

            self.sp = SequenceParallel.create(self.sp_size, self.device.type)
        torch.manual_seed(self.cfg.trainer.seed + self.rank)
        dtype = getattr(torch, self.cfg.model.dtype)
        # Master weights in fp32; bf16 only for compute (mixed precision) when asked. Packed rows on GPU attend
        # through varlen flash attention (rayrl.attention); elsewhere transformers' default (sdpa) masks them.
        flash = dtype in (torch.bfloat16, torch.float16)  # the flash kernel has no fp32; sdpa masks packed rows then
        attn = attention.register() if (self.use_cuda and self.cfg.learner.pack and flash) or self.sp else None
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation=attn)
        if self.sp is not None and (why := sequence_parallel_heads_error(
                model.config.num_attention_heads, model.config.num_key_value_heads, self.sp_size)):
            raise ValueError(f"model.path {self.model_path!r}: {why}")
        model.config.use_cache = False
        if self.cfg.learner.pack:  # the lm_head fused into the log-prob kernel: no [tokens x vocab] logits
            model.lm_head = LogprobHead(model.lm_head, compiled=self.compiled)
        model.to(self.device)
        # each layer's forward checkpointed, then compiled (the forward only: FSDP's hooks around it stay eager, as
        # in torchtitan)
        recompute.wrap_layers(model.model.layers, self.cfg.model.gradient_checkpointing,
                              self.cfg.model.gradient_checkpointing_keep_attention, self.compiled, self.layer_dynamic)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # Shard each decoder layer, then the root (embeddings, norm, lm_head) — FSDP2's usual wrapping. By default one
        # rank keeps the gathered bf16 copy from forward to backward instead of gathering it twice (learner.
        # reshard_after_forward: true frees it, 2 bytes a parameter, for a copy per layer and micro-batch).
        reshard = self.reshard_after_forward
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
        self.model = model
        self.ref = None
        if self.cfg.algo.use_kl_loss:  # a frozen copy of the initial policy, sharded the same way
            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32,
                                                       attn_implementation=attn).to(self.device).eval()
            ref.requires_grad_(False)
            if self.cfg.learner.pack:
                ref.lm_head = LogprobHead(ref.lm_head, compiled=self.compiled)
            for layer in ref.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(ref, mp_policy=mp)
            self.ref = ref
        lc = self.cfg.learner
        self.optim = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                                       weight_decay=lc.weight_decay, fused=self.use_cuda)
        self._optim_cpu = offload.PinnedCopies(pin=self.use_cuda)  # learner.optimizer_offload's CPU side
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
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
        n = len(token_budget_bins(lengths, lc.max_tokens_per_micro_batch))
        if self.world_size > 1:  # the driver gives every rank as many sequences, so every rank can split to the max
            count = torch.tensor([n], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            n = int(count.item())
        return token_budget_bins(lengths, lc.max_tokens_per_micro_batch, min_bins=n)

    def _logprobs(self, batch: TrainBatch, idx: list[int], model=None, entropy: bool = False,
                  temperature: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probs of the response tokens of sequences `idx`, with their loss mask, advantages and (with
        `entropy`, else None) the policy's entropy at each of those positions, from the same chunked pass; each
        right-padded to [len(idx), T_resp] (zeros after each response) as rayrl.algos wants them. `temperature`:
        None = rollout.temperature."""
        model = model or self.model
        prompts, resps = [batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx]
        plen, rlen = np.array([len(p) for p in prompts]), np.array([len(r) for r in resps])
        lengths = plen + rlen
        targets = self._dev(np.fromiter(itertools.chain.from_iterable(resps), np.int64))
        # temperature: the distribution the tokens were sampled from (verl's entropy is of that one too)
        t = self.cfg.rollout.temperature if temperature is None else temperature
        # logits at position t predict token t+1: a response of n tokens after a prompt of p is predicted by
        # [p-1, p+n-1)
        if self.cfg.learner.pack:
            # One row, no padding: positions restart at 0 at each sequence, which transformers reads as packed
            # sequences (block-diagonal causal mask for sdpa/eager, varlen for flash attention).
            seqs = (p + r for p, r in zip(prompts, resps, strict=True))
            ids = np.fromiter(itertools.chain.from_iterable(seqs), np.int64)
            bounds = np.concatenate([[0], np.cumsum(lengths)])  # where each sequence starts, and the end
            keep = np.repeat(bounds[:-1] + plen - 1, rlen) + _aranges(rlen)
            row, positions = self._dev(ids[None]), self._dev(_aranges(lengths)[None])
            if self.sp is not None:  # this rank's 1/k of the row and of its response positions (rayrl.ulysses)
                row, positions, padded = self.sp.split_row(row, positions)
                bounds = np.append(bounds, padded) if padded > bounds[-1] else bounds  # the padding: a sequence
                counts = self.sp.keep_counts(keep, padded)
                keep, targets = self.sp.local_keep(keep, targets, padded)
            # Sequence boundaries for flash attention's varlen kernel, which otherwise derives them from position_ids
            # in every layer (the other attention implementations ignore them).
            cu, longest = self._dev(bounds, torch.int32), int(np.diff(bounds).max())
            varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
            if self.sp is not None:
                varlen["sequence_parallel"] = self.sp  # read by rayrl.attention.varlen_attention
            # logits_to_keep: the lm_head runs on the response-predicting positions only, and it is a LogprobHead
            # bound to their targets: the model's "logits" are the log-probs (and entropies), [N_resp, 1 or 2].
            # use_cache=False: with a KV cache transformers ignores the packing (the reference model keeps use_cache).
            model.lm_head.bind(targets, t, entropy)
            try:
                out = model(input_ids=row, position_ids=positions, logits_to_keep=self._dev(keep), use_cache=False,
                            **varlen).logits[0]
            finally:
                model.lm_head.bind(None)
            if self.sp is not None:  # every rank of the group: the whole shard's log-probs
                out = self.sp.gather(out, counts)
            lp, ent = out[:, 0], (out[:, 1] if entropy else None)
        else:  # right-padded to the longest sequence, full logits (the pre-packing path, kept for comparison)
            ids = np.zeros((len(idx), lengths.max()), dtype=np.int64)
            for j, (p, r) in enumerate(zip(prompts, resps, strict=True)):
                ids[j, : len(p) + len(r)] = p + r
            attn = (np.arange(lengths.max())[None] < lengths[:, None]).astype(np.int64)
            rows, cols = np.repeat(np.arange(len(idx)), rlen), np.repeat(plen - 1, rlen) + _aranges(rlen)
            logits = model(input_ids=self._dev(ids), attention_mask=self._dev(attn)).logits[self._dev(rows),
                                                                                              self._dev(cols)]
            if entropy:
                lp, ent = token_logprobs_entropy(logits, targets, t, compiled=self.compiled)
            else:
                lp, ent = token_logprobs(logits, targets, t, compiled=self.compiled), None
        t_resp = int(rlen.max())
        where = (self._dev(np.repeat(np.arange(len(idx)), rlen)), self._dev(_aranges(rlen)))

        def padded(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(len(idx), t_resp, device=self.device).index_put(where, values)

        return (padded(lp), self._padded([batch.loss_mask[i] for i in idx], t_resp),
                self._padded([batch.advantages[i] for i in idx], t_resp), None if ent is None else padded(ent))

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
        gradients in fp32, so they reduce every micro-batch, as one rank does when learner.reshard_after_forward
        frees the gathered weights."""
        if self.world_size == 1 and not self.reshard_after_forward:
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

    def warm_up(self) -> dict[str, float | str]:
        """With learner.compile: compile the decoder layers and the log-prob kernels before the first step, so the
        first train_step does not (21.6 s of the first step's 32.8 s in a 135M-model ReTool job on an H100 host:
        BENCHMARKS.md). Synthetic micro-batches that differ in every size that varies (tokens, sequences,
        the longest sequence) run forward and backward as train_step's do, and forward as compute_logprobs' do, so
        the dynamic graphs a real batch uses are the ones compiled here; their gradients are dropped and no
        optimizer step is taken, so the weights and the optimizer state do not change. All ranks call it together;
        the driver (rayrl.train) starts it beside the first rollout where GPU learners keep their memory between
        steps (not during the engines' start: vLLM would count the learner's memory against its KV cache; not on
        CPU, where the compile takes the rollout's cores). A failure here is only logged: the first step then
        compiles as it always did. Returns its seconds."""
        if not self.compiled:
            return {}
        t0 = time.perf_counter()
        vocab = min(self.model.config.vocab_size, 1000)
        # The row that makes the sizes dynamic is as long as a real micro-batch: inductor picks its kernels' configs
        # for the sizes of that compile. (prompt, response) tokens of rows [0, 1] (small), [2, 3, 4] (a micro-batch's
        # tokens) and [5] (one sequence: no mask where sdpa masks a row)
        lc, n = self.cfg.learner, self.cfg.data.max_prompt_length + self.cfg.rollout.max_response_length
        full = lc.max_tokens_per_micro_batch or lc.micro_batch_size * n
        third = max(full // 3, 4)
        shapes = [(24, 16), (16, 24), *[(third // 2, third - third // 2)] * 2, (third // 3, third - third // 3),
                  (10, 12)]
        ids = [[(7 * i + j) % (vocab - 1) + 1 for j in range(p + r)] for i, (p, r) in enumerate(shapes)]
        batch = TrainBatch(prompt_ids=[s[:p] for s, (p, _) in zip(ids, shapes, strict=True)],
                           response_ids=[s[p:] for s, (p, _) in zip(ids, shapes, strict=True)],
                           loss_mask=[[1] * r for _, r in shapes], advantages=[[1.0] * r for _, r in shapes],
                           global_tokens=sum(r for _, r in shapes), global_seqs=len(shapes))
        rows = ([0, 1], [2, 3, 4], [5])
        try:
            self.model.train()
            for idx in rows:
                self._accumulate_locally(False)
                lp, mask, _, ent = self._logprobs(batch, idx, entropy=True)
                # the entropy in the loss as train_step has it (only with algo.entropy_coeff): the same backward
                ((lp + ent if self.cfg.algo.entropy_coeff else lp) * mask).sum().backward()
            self.model.eval()  # compute_logprobs' graphs (old log-probs of steps with several updates), dynamic
            with torch.no_grad():  # from their first compile: the long row first
                for idx in (rows[1], rows[0], rows[2]):
                    self._logprobs(batch, idx)
        except Exception as e:  # noqa: BLE001 - the first train_step compiles instead (and raises, if it must)
            print(f"learner rank {self.rank}: warm-up failed, the first step compiles instead: {e!r}")  # noqa: T201
            return {"error": repr(e)}
        finally:
            self.optim.zero_grad(set_to_none=True)
        return {"seconds": time.perf_counter() - t0}

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Current policy's log-probs of every response token (for old-logprob recompute and for tests)."""
        self._resident()
        self.model.eval()
        res: list[list[float]] = [[] for _ in range(len(batch))]
        for idx in self._micro_batches(batch):
            lp = self._logprobs(batch, idx)[0].cpu()
            for j, i in enumerate(idx):
                res[i] = lp[j, : len(batch.response_ids[i])].tolist()
        return res

    def train_step(self, batch: TrainBatch, old_logprobs: list[list[float]] | None = None) -> StepStats:
        """One optimizer step on this rank's share of a mini-batch (all ranks call it together).

        `old_logprobs=None` means one update (one mini-batch, one epoch, no rollout rejection; the episodes may be
        stale): the proximal policy is the current one, so old = current.detach() and the ratio is exactly 1 — the
        recompute would be a second identical forward pass; those log-probs come back in StepStats.logprobs (the
        driver's engine-vs-learner mismatch metrics), and algo.rollout_correction.rollout_is's weights are computed
        here from them. Otherwise `batch.is_weights` (set by the driver) weighs each token's loss. With
        algo.rollout_correction.bypass_mode the engines' log-probs (`batch.rollout_logprobs`) are the old ones, and
        `old_logprobs` is None for every mini-batch.
        The entropy is computed every step (logged); it enters the loss as verl's bonus,
        - algo.entropy_coeff x entropy aggregated by loss_agg_mode, when the coefficient is not 0.
        """
        t0, start_wall = time.perf_counter(), time.time()
        moves = self._resident()
        start = self._mark()
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        events: list[dict] = []  # forward / backward per micro-batch, then the optimizer step: spans for the trace

        def event(name: str, s: float, e: float, **args) -> None:
            events.append({"name": name, "start": s, "end": e, "rank": self.rank, "args": args})

        micro_batches = self._micro_batches(batch)
        corr = self.cfg.algo.rollout_correction
        current: list[tuple[list[int], torch.Tensor]] = []  # one update: (rows, their log-probs) for StepStats.logprobs
        for k, idx in enumerate(micro_batches):
            self._accumulate_locally(k < len(micro_batches) - 1)
            f0 = self._mark()
            lp, mask, adv, ent = self._logprobs(batch, idx, entropy=True)
            if old_logprobs is not None:
                old = self._padded([old_logprobs[i] for i in idx], lp.shape[1])
            elif corr.bypass_mode:  # PPO's ratio is current / engine: its clip binds on stale tokens
                old = self._padded([batch.rollout_logprobs[i] for i in idx], lp.shape[1])
            else:
                old = lp.detach()
            if old_logprobs is None:
                current.append((idx, lp.detach()))
            is_weights = None if batch.is_weights is None else self._padded([batch.is_weights[i] for i in idx],
                                                                            lp.shape[1])
            if old_logprobs is None and corr.rollout_is is not None:  # one update: proximal = current, so in the loss
                is_weights = algos.rollout_is_weights(
                    old, self._padded([batch.rollout_logprobs[i] for i in idx], lp.shape[1]), mask, corr)
            # Normalised by mini-batch-wide counts, so summing micro-batches and averaging ranks (FSDP) gives
            # exactly the mini-batch loss (see rayrl.algos).
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(batch, idx, model=self.ref)[0]
            # entropy_coeff 0: the entropy stays out of the loss and its backward (it is only logged)
            loss, metrics = algos.policy_loss(old, lp, adv, mask, self.cfg.algo, ref_logprobs=ref,
                                              entropy=ent if self.cfg.algo.entropy_coeff else None,
                                              global_token_count=batch.global_tokens,
                                              global_seq_count=batch.global_seqs,
                                              dp_size=self.world_size // self.sp_size,  # data-parallel groups
                                              loss_scale_factor=self.cfg.rollout.max_response_length,
                                              rollout_is_weights=is_weights)
            f1 = self._mark()
            loss.backward()
            b1 = self._mark()
            tokens = sum(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in idx)
            event("forward", f0, f1, micro_batch=k, sequences=len(idx), tokens=tokens)
            event("backward", f1, b1, micro_batch=k, sequences=len(idx), tokens=tokens)
            # No .item() after backward: the next micro-batch's inputs are built while the GPU still runs this one.
            # its token means' weight (k ranks of a sequence-parallel group report the same shard: 1/k each)
            share = sum(sum(batch.loss_mask[i]) for i in idx) / max(batch.global_tokens, 1) / self.sp_size
            sums["loss"] = sums.get("loss", 0.0) + loss.detach() / self.world_size
            # token-mean over the mini-batch's loss mask (all ranks): this micro-batch's share
            sums["entropy"] = sums.get("entropy", 0.0) + (ent.detach() * mask).sum() / max(batch.global_tokens, 1) \
                / self.sp_size
            for key in ("pg_clipfrac", "ppo_kl"):
                sums[key] = sums.get(key, 0.0) + float(metrics[key]) * share
            if "kl_loss" in metrics:  # already this micro-batch's share of the mini-batch value
                sums["kl_loss"] = sums.get("kl_loss", 0.0) + float(metrics["kl_loss"]) / self.world_size
        o0 = self._mark()
        grad_norm = self._optimizer_step(moves)
        end = self._mark()
        event("optimizer_step", o0, end, grad_norm=grad_norm)
        event("train_step", start, end, sequences=len(batch))
        self._times(events, start_wall, start)  # on GPU: waits for the step to finish (seconds below include it)
        # loss, pg_clipfrac, ppo_kl, entropy are this rank's shares of the mini-batch values: the driver sums over ranks
        out = {k: float(v) for k, v in sums.items()}
        for m in moves:  # offload/<what>_to_<cpu|cuda>_s, seconds of this step's moves
            key = f"offload/{m.what}_to_{m.device.split(':')[0]}_s"
            out[key] = out.get(key, 0.0) + m.seconds
        main = ("loss", "pg_clipfrac", "ppo_kl", "entropy")
        logprobs = None
        if old_logprobs is None:  # read after the step: no wait for the GPU between micro-batches
            logprobs = [[] for _ in range(len(batch))]
            for idx, lp in current:
                rows = lp.cpu().tolist()
                for j, i in enumerate(idx):
                    logprobs[i] = rows[j][: len(batch.response_ids[i])]
        return StepStats(loss=out.get("loss", 0.0), pg_clipfrac=out.get("pg_clipfrac", 0.0),
                         ppo_kl=out.get("ppo_kl", 0.0), entropy=out.get("entropy", 0.0), grad_norm=grad_norm,
                         num_tokens=int(sum(sum(m) for m in batch.loss_mask)), seconds=time.perf_counter() - t0,
                         extra={k: v for k, v in out.items() if k not in main}, events=events, logprobs=logprobs)

    def _optimizer_step(self, moves: list) -> float:
        """Clip the accumulated gradients, step (skipped when their norm is not finite: they overflowed), free them.
        Returns the global gradient norm before clipping; appends the optimizer state's moves (optimizer_offload).
        A background save's copy of the parameters and the optimizer state ends first (the forward and backward
        passes before ran beside it)."""
        self._staged()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.learner.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if np.isfinite(grad_norm):
            if self.cfg.learner.optimizer_offload:  # the AdamW state is on the GPU for the step only
                moves.append(offload.timed("optimizer", self.device, offload.move_optimizer, self.optim,
                                           self._optim_cpu))
            self.optim.step()
            if self.cfg.learner.optimizer_offload:
                moves.append(offload.timed("optimizer", torch.device("cpu"), offload.move_optimizer, self.optim,
                                           self._optim_cpu))
        self.optim.zero_grad(set_to_none=True)  # the gradients' memory is free until the next backward
        return grad_norm

    # --- supervised fine-tuning (rayrl.sft) --------------------------------------------------------

    def sft_step(self, batch: TrainBatch, lr: float) -> StepStats:
        """One SFT optimizer step at learning rate `lr` on this rank's share of a batch (all ranks call it together):
        loss = -log p(token) token-mean over the loss mask (the assistant's tokens) of the whole batch, all ranks
        (batch.global_tokens), at temperature 1. The same packed micro-batches and log-prob pass as train_step.
        `loss` is this rank's share (the driver sums over ranks)."""
        t0 = time.perf_counter()
        moves = self._resident()
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        for group in self.optim.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        micro_batches = self._micro_batches(batch)
        for k, idx in enumerate(micro_batches):
            self._accumulate_locally(k < len(micro_batches) - 1)
            nll = self._nll(batch, idx)
            # x data-parallel groups: FSDP averages the gradients over ranks, the loss is a sum over all of them
            (nll * (self.world_size // self.sp_size)).backward()
            loss_sum += nll.detach()
        grad_norm = self._optimizer_step(moves)
        return StepStats(loss=float(loss_sum) / self.sp_size, pg_clipfrac=0.0, ppo_kl=0.0, entropy=0.0,
                         grad_norm=grad_norm, num_tokens=int(sum(sum(m) for m in batch.loss_mask)),
                         seconds=time.perf_counter() - t0)

    @torch.no_grad()
    def sft_loss(self, batch: TrainBatch) -> float:
        """This rank's share of the batch's SFT loss (as sft_step computes it), without a step: validation."""
        self._resident()
        self.model.eval()
        return sum(float(self._nll(batch, idx)) for idx in self._micro_batches(batch)) / self.sp_size

    def _nll(self, batch: TrainBatch, idx: list[int]) -> torch.Tensor:
        """Sum of -log p over the loss mask of sequences `idx`, divided by the batch's global token count."""
        lp, mask, _, _ = self._logprobs(batch, idx, temperature=1.0)
        return -(lp * mask).sum() / max(batch.global_tokens, 1)

    # --- weights out -----------------------------------------------------------------------------

    def _full_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Collective: every rank must call. With cpu_offload only rank 0 keeps the gathered tensors.
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def gpus(self) -> tuple[str, tuple[str, ...]]:
        """(node id, GPU ids) of this rank, for engine.weight_sync=auto."""
        return weight_sync.local_gpus()

    def connect_weights(self, strategy: str, setup) -> None:
        """`strategy`'s one-time setup on this rank (broadcast: rank 0 joins the learner -> engines group while the
        engines do)."""
        self._senders[strategy].connect(self.model, setup)

    def send_weights(self, strategy: str, version: int, serve: bool = True):
        """One sync's learner side; every rank calls (the gathers are collectives). `serve`: this rank delivers the
        weights. Returns what the engines receive (object_store: the packet, cuda_ipc: the buffer's handle) or None."""
        self._resident()
        return self._senders[strategy].send(self.model, version, serve)

    def export_hf(self, out_dir: str) -> str | None:
        """Write the policy as a Hugging Face folder (rayrl.export.write_hf) from rank 0; every rank must call (the
        full state dict is gathered collectively)."""
        self._resident()
        state = self._full_state()
        return (write_hf(state, self.model_path, out_dir, self.cfg.model.chat_template, self.cfg.model.dtype)
                if self.rank == 0 else None)

    # --- checkpoints -----------------------------------------------------------------------------

    def save(self, ckpt_dir: str, background: bool = False) -> None:
        """Sharded model + optimizer (torch.distributed.checkpoint) and this rank's RNG into ckpt_dir. `background`
        (trainer.async_save): DCP's async_save copies the state into CPU memory from a thread (`_staging`) and then
        writes it from another, while the learner goes on; the next call that changes the parameters or the optimizer
        state waits for the copy (`_staged`), `written()` for the write. A save first waits for the previous one's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.written()
        self._resident()
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        state, path = {"model": model_sd, "optim": optim_sd}, os.path.join(ckpt_dir, "learner")
        if background:
            if self.use_cuda:  # the copy runs on its own stream: what the step queued on the GPU comes first
                torch.cuda.current_stream().synchronize()
            stager = self._staging()
            self._writing = dcp.async_save(state, checkpoint_id=path, process_group=self._save_group,
                                           async_stager=stager)
            self._writing.upload_completion.add_done_callback(lambda _: stager.close())
        else:
            dcp.save(state, checkpoint_id=path)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if self.use_cuda else None}
        torch.save(rng, os.path.join(ckpt_dir, f"rng_rank{self.rank}.pt"))

    def _staging(self):
        """A stager for one background save (DCP's DefaultStager): on a GPU it copies into pinned CPU buffers on its
        own CUDA stream, on CPU in its thread. The learner is then held only for the state dict's views: the copy
        (~1.5 s for a 135M model's ~2 GB state from an H100 into pageable memory inside the call before:
        BENCHMARKS.md) overlaps the weight sync and the next rollout. One per save, closed (its buffers freed) once
        the write ends: torch 2.11's stager cannot copy twice (it clears its copier after each copy)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=self.use_cuda, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=self.use_cuda))

    def _staged(self) -> None:
        """Wait until the last background save has copied the state: the optimizer step, a load and the offloads
        change what the copy reads."""
        staging = getattr(self._writing, "staging_completion", None)
        if staging is not None:
            staging.result()

    def written(self) -> None:
        """Wait for the background write of the last save (its error is raised here); at once when there is none."""
        writing, self._writing = self._writing, None
        if writing is not None:  # a Future, or an AsyncSaveResponse where DCP stages in the background too
            getattr(writing, "upload_completion", writing).result()

    def load(self, ckpt_dir: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._resident()
        self._staged()
        for sender in self._senders.values():  # the load may replace parameter storage
            sender.params_replaced()
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

    # --- GPU memory (colocated with engines: rayrl.colocate) ------------------------------------------------------

    def offload(self) -> list[offload.Moved]:
        """The GPU to the engines until the next call that needs it: the weight-sync memory they do not keep open, and
        with learner.param_offload the parameters and gradients (and the frozen reference) to CPU memory; the
        optimizer state already lives there between steps with optimizer_offload."""
        if not self.use_cuda:
            return []
        self._staged()
        for sender in self._senders.values():  # e.g. cuda_ipc's buffer, which sleeping engines closed after loading
            sender.release()
        if not self.cfg.learner.param_offload or self.params_offloaded:
            return []
        for sender in self._senders.values():  # drop their views of the GPU storage, or it stays allocated
            sender.params_replaced()
        cpu = torch.device("cpu")
        moved = [offload.timed("params", cpu, offload.move_model, m) for m in (self.model, self.ref) if m is not None]
        self.params_offloaded = True
        return moved

    def _resident(self) -> list[offload.Moved]:
        """Parameters back on the GPU if offload() moved them (their storage changes: the senders re-read it; a
        background save's copy ends first). Calls that only read them (forward passes, a weight sync) go on beside
        that copy; what changes them waits for it (`_optimizer_step`, `load`)."""
        if not self.params_offloaded:
            return []
        self._staged()
        moved = [offload.timed("params", self.device, offload.move_model, m) for m in (self.model, self.ref)
                 if m is not None]
        for sender in self._senders.values():
            sender.params_replaced()
        self.params_offloaded = False
        return moved

    def memory(self) -> dict[str, float]:
        """GiB of this rank's GPU: free on the device (every process on it counted), allocated and reserved by this
        process; empty on CPU."""
        if not self.use_cuda:
            return {}
        free, total = torch.cuda.mem_get_info()
        return {"free_gib": free / 2**30, "total_gib": total / 2**30,
                "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30}

    def shutdown(self) -> None:
        for sender in self._senders.values():  # e.g. the learner -> engines weight group (broadcast)
            sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _aranges(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each n in counts, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)

