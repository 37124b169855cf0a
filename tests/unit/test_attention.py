"""rayrl_varlen: packed rows through the registered attention function give each sequence's own logits."""

from __future__ import annotations

import torch

from rayrl import attention


def test_packed_rows_through_varlen_attention_match_separate_forwards(tiny_model):
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation=attention.NAME).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the GQA path is exercised
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (7, 19, 3, 12)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(s) for s in seqs]), 0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=19, max_length_k=19).logits[0]
        alone = torch.cat([plain(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    assert torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()


def test_unpacked_input_is_refused(tiny_model):
    import pytest
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attention.NAME).eval()
    with pytest.raises(RuntimeError, match="packed rows only"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
