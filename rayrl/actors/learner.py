"""LearnerWorker: one FSDP2 rank. Logprobs, GRPO loss (verl core_algos via rayrl.algos), optimizer step,
weight streaming to the engines, and sharded checkpoints.

N workers form one process group (gloo on CPU, nccl on GPU); each holds a `fully_shard` shard of
the model and the optimizer state. The driver gives each rank an equal share of every mini-batch.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import time

import numpy as np
import ray
import torch
import torch.distributed as dist

from rayrl import algos
from rayrl.config import Config
from rayrl.types import StepStats, TrainBatch
from rayrl.weights import WeightsPacket, pack


class Learner:
    """Plain class (usable without Ray); `LearnerWorker` below is the Ray actor."""

    def __init__(self, model_path: str, cfg: Config, rank: int = 0, world_size: int = 1):
        self.model_path, self.cfg, self.rank, self.world_size = model_path, cfg, rank, world_size
        self.use_cuda = cfg.learner.gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")

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
        # Master weights in fp32; bf16 only for compute (mixed precision) when asked.
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        if model.config.tie_word_embeddings:
            raise ValueError(f"model.path={self.model_path!r} has tied embeddings: engines cannot reload a tied "
                             "lm_head; untie it (see rayrl.models.convert_smollm2)")
        if self.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.to(self.device)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # Shard each decoder layer, then the root (embeddings, norm, lm_head) — FSDP2's usual wrapping.
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.model = model
        self.ref = None
        if self.cfg.algo.use_kl_loss:  # a frozen copy of the initial policy, sharded the same way
            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device).eval()
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

    def _micro_batches(self, batch: TrainBatch):
        mb = self.cfg.learner.micro_batch_size
        for i in range(0, len(batch), mb):
            yield i, min(i + mb, len(batch))

    def _logprobs(self, batch: TrainBatch, lo: int, hi: int, model=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens of sequences [lo, hi), right-padded to [b, T_resp]."""
        pad = 0
        seqs = [p + r for p, r in zip(batch.prompt_ids[lo:hi], batch.response_ids[lo:hi])]
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s)
            attn[j, : len(s)] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        logits = (model or self.model)(input_ids=ids, attention_mask=attn).logits.float()
        logits = logits / self.cfg.rollout.temperature  # the distribution the tokens were sampled from
        t_resp = max(len(r) for r in batch.response_ids[lo:hi])
        out = torch.zeros(len(seqs), t_resp, device=self.device)
        mask = torch.zeros(len(seqs), t_resp, device=self.device)
        adv = torch.zeros(len(seqs), t_resp, device=self.device)
        for j in range(len(seqs)):
            p, n = len(batch.prompt_ids[lo + j]), len(batch.response_ids[lo + j])
            # logits at position t predict token t+1: the response's tokens are predicted by [p-1, p+n-1)
            lg = logits[j, p - 1 : p + n - 1]
            tgt = ids[j, p : p + n]
            out[j, :n] = lg.gather(-1, tgt[:, None])[:, 0] - torch.logsumexp(lg, -1)
            mask[j, :n] = torch.tensor(batch.loss_mask[lo + j], dtype=torch.float32, device=self.device)
            adv[j, :n] = torch.tensor(batch.advantages[lo + j], dtype=torch.float32, device=self.device)
        return out, mask, adv

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Current policy's log-probs of every response token (for old-logprob recompute and for tests)."""
        self.model.eval()
        res = []
        for lo, hi in self._micro_batches(batch):
            lp, _, _ = self._logprobs(batch, lo, hi)
            res += [lp[j, : len(batch.response_ids[lo + j])].tolist() for j in range(hi - lo)]
        return res

    def train_step(self, batch: TrainBatch, old_logprobs: list[list[float]] | None = None) -> StepStats:
        """One optimizer step on this rank's share of a mini-batch (all ranks call it together).

        `old_logprobs=None` means on-policy (one mini-batch, one epoch, staleness 0): the behaviour policy
        is the current one, so old = current.detach() and the ratio is exactly 1 — the recompute would be
        a second identical forward pass.
        """
        t0 = time.perf_counter()
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for lo, hi in self._micro_batches(batch):
            lp, mask, adv = self._logprobs(batch, lo, hi)
            if old_logprobs is None:
                old = lp.detach()
            else:
                old = torch.zeros_like(lp)
                for j in range(hi - lo):
                    o = old_logprobs[lo + j]
                    old[j, : len(o)] = torch.tensor(o, device=self.device)
            # Normalised by mini-batch-wide counts, so summing micro-batches and averaging ranks (FSDP) gives
            # exactly the mini-batch loss (see rayrl.algos).
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(batch, lo, hi, model=self.ref)[0]
            loss, metrics = algos.policy_loss(old, lp, adv, mask, self.cfg.algo, ref_logprobs=ref,
                                              global_token_count=batch.global_tokens,
                                              global_seq_count=batch.global_seqs, dp_size=self.world_size,
                                              loss_scale_factor=self.cfg.rollout.max_response_length)
            loss.backward()
            share = mask.sum().item() / max(batch.global_tokens, 1)  # weight of this micro-batch's token means
            sums["loss"] = sums.get("loss", 0.0) + loss.item() / self.world_size
            for k in ("pg_clipfrac", "ppo_kl"):
                sums[k] = sums.get(k, 0.0) + float(metrics[k]) * share
            if "kl_loss" in metrics:  # already this micro-batch's share of the mini-batch value
                sums["kl_loss"] = sums.get("kl_loss", 0.0) + float(metrics["kl_loss"]) / self.world_size
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.learner.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if np.isfinite(grad_norm):
            self.optim.step()
        else:
            self.optim.zero_grad(set_to_none=True)  # skip a step whose gradients overflowed
        # loss, pg_clipfrac, ppo_kl are this rank's shares of the mini-batch values: the driver sums over ranks
        return StepStats(loss=sums.get("loss", 0.0), pg_clipfrac=sums.get("pg_clipfrac", 0.0),
                         ppo_kl=sums.get("ppo_kl", 0.0), grad_norm=grad_norm, entropy=0.0,
                         num_tokens=int(sum(sum(m) for m in batch.loss_mask)), seconds=time.perf_counter() - t0,
                         extra={k: v for k, v in sums.items() if k not in ("loss", "pg_clipfrac", "ppo_kl")})

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
        if dist.is_initialized():
            dist.destroy_process_group()


def _replace_dir(tmp: str, final: str) -> None:
    import shutil

    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)


LearnerWorker = ray.remote(Learner)
