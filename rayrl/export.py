"""Hugging Face folders from the policy: `write_hf` (a full state dict + the base model's files), used by the learner
at the end of a run and by `rayrl export-hf CKPT -o DIR` (a sharded learner checkpoint; verl's model_merger step)."""

from __future__ import annotations

import os
import shutil

from rayrl import templates
from rayrl.checkpoint import load_state
from rayrl.models import resolve_model


def export_hf(ckpt: str, out_dir: str, model: str | None = None, dtype: str | None = None) -> str:
    """Merge the model shards of `ckpt` (torch.distributed.checkpoint; the optimizer state is not read) into
    `out_dir`, with the base model's config, tokenizer and chat template. The base model is the one the run started
    from, recorded in the checkpoint (`model` overrides it); the weights are written in the run's model.dtype, also
    recorded (`dtype` overrides it; a checkpoint that records none keeps the stored float32). Runs in one process,
    no GPU needed."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    learner_dir = os.path.join(ckpt, "learner")
    if not os.path.isdir(learner_dir):
        raise FileNotFoundError(f"{ckpt!r} is not a rayrl checkpoint (no learner/ inside)")
    if model is None:
        model = load_state(ckpt).get("model_path") if os.path.exists(os.path.join(ckpt, "trainer_state.json")) else None
        if model is None:
            raise ValueError(f"{ckpt!r} does not record the model the run started from (written before "
                             "2026-12-03): pass --model PATH")
    base = resolve_model(model)
    recorded = load_state(ckpt) if os.path.exists(os.path.join(ckpt, "trainer_state.json")) else {}
    state = _load_state_dict_from_keys(keys={"model"}, checkpoint_id=learner_dir)["model"]
    return write_hf(state, base, out_dir, recorded.get("chat_template"), dtype or recorded.get("dtype"))


def write_hf(state: dict, base: str, out_dir: str, chat_template: str | None = None, dtype: str | None = None) -> str:
    """Write `state` (full tensors by parameter name) as `out_dir`/model.safetensors beside the config, tokenizer,
    chat template and generation config (when it has one) of the base model folder `base`; `dtype` (float32,
    bfloat16, float16) casts the floating-point tensors and is recorded in config.json. Staged in a sibling folder and
    renamed into place, replacing an older `out_dir`. A tied model's lm_head is written once, as the embedding
    (`untied_state`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(base)
    state = untied_state(state, config)
    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
        wanted = getattr(torch, dtype)
        state = {k: v.to(wanted) if v.is_floating_point() else v for k, v in state.items()}
        config.dtype = wanted
    staging = out_dir + ".tmp"
    os.makedirs(staging, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(staging, "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(staging)
    templates.tokenizer(base, chat_template).save_pretrained(staging)  # with the template the run rendered with
    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:  # the base model has none: the defaults its config implies (eos, bos, pad token ids)
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(staging)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(staging, out_dir)
    return out_dir


def untied_state(state: dict, config) -> dict:
    """`state` without the names that `config`'s model ties to another (tie_word_embeddings: `lm_head.weight` is
    `model.embed_tokens.weight`), as Hugging Face saves a tied model; transformers and vLLM tie them back at load.
    The tied names come from the model itself, built on the meta device (no memory). Raises if a tied pair holds
    different values: that state was not trained tied."""
    import torch
    from transformers import AutoModelForCausalLM

    from rayrl.weight_sync.layout import aliases

    with torch.device("meta"):
        tied = aliases(AutoModelForCausalLM.from_config(config))
    for alias, first in tied.items():
        if alias in state and first in state and not torch.equal(state[alias], state[first]):
            raise ValueError(f"{alias} differs from {first}, which the model config ties it to")
    return {k: v for k, v in state.items() if k not in tied}
