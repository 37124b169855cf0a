"""Tied embeddings (Qwen3-0.6B/1.7B/4B, Qwen2.5-0.5B): one Parameter for embed_tokens and lm_head through the
learner (FSDP2), its checkpoints and Hugging Face export, and weight sync (the shared tensor travels once, under the
embedding's name, which vLLM loads; the engines tie it back). The engines' side on CPU vLLM:
tests/integration/test_tied_sync.py; cuda_ipc: tests/gpu/test_gpu_weight_sync.py."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from rayrl.config import load_config
from rayrl.types import TrainBatch
from rayrl.weight_sync import cuda_ipc, layout

BATCH = TrainBatch(prompt_ids=[[1, 2, 3, 4], [5, 6, 7]], response_ids=[[8, 9, 10], [11, 12]],
                   loss_mask=[[1, 1, 1], [1, 0]], advantages=[[1.0] * 3, [-1.0] * 2], global_tokens=4, global_seqs=2)
LR = 1e-2


@pytest.fixture
def learner(tied_model):
    from rayrl.learner import Learner

    ln = Learner(tied_model, load_config(None, [f"learner.lr={LR}"], check_files=False))
    ln.setup()
    yield ln
    ln.shutdown()


def _embedding(learner) -> torch.Tensor:
    return learner.model.model.embed_tokens.weight


def test_one_shared_parameter_stepped_once(learner):
    """After fully_shard the lm_head still holds the embedding's Parameter (one sharded DTensor), the optimizer has
    it once, and one step moves it by AdamW's first-step size, lr: a parameter stepped once per use would move 2 lr."""
    from torch.distributed.tensor import DTensor

    emb = _embedding(learner)
    assert isinstance(emb, DTensor) and learner.model.lm_head.weight is emb
    params = [p for g in learner.optim.param_groups for p in g["params"]]
    assert sum(p is emb for p in params) == 1
    before = emb.to_local().detach().clone()
    learner.train_step(BATCH)
    assert learner.model.lm_head.weight is emb
    assert (emb.to_local().detach() - before).abs().max().item() == pytest.approx(LR, rel=1e-3)


def test_gradient_is_the_sum_of_both_uses(learner, tied_model):
    """The shared weight's gradient (FSDP2, log-probs through the fused lm_head) equals transformers' on one plain
    tied model: the embedding's rows plus the lm_head's."""
    from transformers import AutoModelForCausalLM

    lp, mask = learner._logprobs(BATCH, [0, 1])[:2]
    (lp * mask).sum().backward()
    got = _embedding(learner).grad.to_local()

    ref = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    t = learner.cfg.rollout.temperature
    total = 0.0
    for p, r, m in zip(BATCH.prompt_ids, BATCH.response_ids, BATCH.loss_mask, strict=True):
        logits = ref(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1]
        logp = (logits / t).log_softmax(-1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        total = total + (logp * torch.tensor(m, dtype=torch.float32)).sum()
    total.backward()
    want = ref.model.embed_tokens.weight.grad
    # the batch's token rows get both uses, every other row the lm_head's alone: each close in norm (fp32, other
    # kernels: ~4e-6 and ~1e-6 here)
    rows = torch.zeros(len(want), dtype=torch.bool)
    rows[sorted({t for seq in BATCH.prompt_ids + BATCH.response_ids for t in seq})] = True
    for sel in (rows, ~rows):
        assert want[sel].norm() > 0 and (got[sel] - want[sel]).norm() / want[sel].norm() < 1e-4


def test_checkpoint_round_trip_keeps_the_tie(learner, tmp_path):
    learner.train_step(BATCH)
    learner.save(str(tmp_path))
    saved = learner.compute_logprobs(BATCH)
    learner.train_step(BATCH)
    assert learner.compute_logprobs(BATCH) != saved
    learner.load(str(tmp_path))
    assert learner.compute_logprobs(BATCH) == saved
    assert learner.model.lm_head.weight is _embedding(learner)


def test_export_writes_the_tied_weight_once(learner, tied_model, tmp_path):
    """Both exports (from the learner, and merged from its DCP checkpoint) hold the embedding and no lm_head, keep
    tie_word_embeddings, and transformers reloads them tied, computing the learner's log-probs."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rayrl.export import export_hf

    learner.train_step(BATCH)
    learner.save(str(tmp_path / "ckpt"))
    want = learner.compute_logprobs(BATCH)
    for out in (learner.export_hf(str(tmp_path / "hf")),
                export_hf(str(tmp_path / "ckpt"), str(tmp_path / "merged"), model=tied_model)):
        with safe_open(f"{out}/model.safetensors", "pt") as f:
            keys = set(f.keys())
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
        m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert m.config.tie_word_embeddings and m.lm_head.weight is m.model.embed_tokens.weight
        with torch.no_grad():
            for i, (p, r) in enumerate(zip(BATCH.prompt_ids, BATCH.response_ids, strict=True)):
                logits = m(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1]
                lp = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None])[:, 0]
                assert torch.allclose(lp, torch.tensor(want[i]), atol=1e-5), out


def test_export_refuses_a_tied_pair_that_differs(tied_model):
    from transformers import AutoConfig

    from rayrl.export import untied_state

    emb = torch.zeros(3, 2)
    config = AutoConfig.from_pretrained(tied_model)
    assert list(untied_state({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, config)) == [
        "model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        untied_state({"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1}, config)


def test_senders_send_the_shared_tensor_once(learner):
    """cuda_ipc and broadcast (layout.specs / full_tensors) and object_store (the packet) carry the embedding once,
    under its own name, and no lm_head."""
    names = [n for n, *_ in layout.specs(learner.model, torch.float32)]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names
    assert len(names) == len(list(learner.model.parameters()))
    assert [n for n, _ in layout.full_tensors(learner.model)] == names
    assert list(learner.send_weights("object_store", 1).arrays) == names


class _Tied(torch.nn.Module):
    """vLLM's (and transformers') layout of a tied model: the lm_head is a module of its own holding the embedding's
    Parameter."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.Parameter(torch.ones(4))
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


def test_aliases_by_identity():
    tied = _Tied()
    assert layout.aliases(tied) == {"lm_head.weight": "embed.weight"}
    assert [n for n, *_ in layout.specs(tied, torch.bfloat16)] == ["norm", "embed.weight"]
    assert [n for n, _ in layout.full_tensors(tied)] == ["norm", "embed.weight"]
    assert layout.aliases(_Tied(tie=False)) == {}
    assert [n for n, *_ in layout.specs(_Tied(tie=False), torch.bfloat16)] == ["norm", "embed.weight",
                                                                                "lm_head.weight"]


def test_direct_copies_apply_to_a_tied_model_sent_once():
    """cuda_ipc's fast path needs every source used: the deduplicated layout gives it; with the alias sent too, it
    would fall back to load_weights every sync."""
    model = _Tied()
    sources = [(n, t.clone()) for n, t in layout.full_tensors(model)]
    copies = cuda_ipc.direct_copies(model, sources)
    assert copies is not None and len(copies[0]) == 2
    assert cuda_ipc.direct_copies(model, sources + [("lm_head.weight", model.embed.weight.detach().clone())]) is None


def test_retie_packs_a_tied_lm_head_again():
    """On the CPU build, after a reload the module that shares the embedding's weight (the lm_head) is processed again
    (its packed GEMM rebuilt from the new embedding); the embedding itself and untied models are left alone."""
    from vllm.platforms import current_platform

    from rayrl.weight_sync.worker import retie

    class Method:
        def __init__(self):
            self.calls = []

        def process_weights_after_loading(self, layer):
            self.calls.append(layer)

    for tie in (True, False):
        model = _Tied(tie)
        method = Method()
        model.embed.quant_method = model.lm_head.quant_method = method
        n = retie(model)
        if current_platform.is_cpu() and tie:
            assert n == 1 and method.calls == [model.lm_head]
        else:
            assert n == 0 and method.calls == []


def test_hf_engine_loads_the_embedding_into_both(tied_model):
    """The hf engine backend gets the packet without lm_head.weight (object_store) and stays tied to the new
    embedding."""
    from transformers import AutoModelForCausalLM

    from rayrl.config import EngineConfig
    from rayrl.engine import Engine
    from rayrl.weight_sync.object_store import pack

    engine = Engine(tied_model, EngineConfig(backend="hf"))
    new = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {k: v for k, v in new.state_dict().items() if k not in layout.aliases(new)}
    assert "lm_head.weight" not in state

    async def go():
        await engine.start()
        await engine.receive_weights("object_store", pack(state, 1), 1)

    asyncio.run(go())
    m = engine._backend.model
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, new.model.embed_tokens.weight)
    asyncio.run(engine.shutdown())


def test_export_reads_the_base_model_from_the_checkpoint(learner, tied_model, tmp_path):
    """`rayrl export-hf CKPT -o OUT` without --model takes the base model the checkpoint records (not SmolLM2's), reads
    no optimizer state, and writes a generation config; a checkpoint that records none asks for --model."""
    import json

    from rayrl import checkpoint
    from rayrl.export import export_hf

    tmp = checkpoint.begin(str(tmp_path / "run"), 1)
    learner.save(tmp)
    ckpt = checkpoint.commit(tmp, 1, {"step": 1, "model_path": checkpoint.base_model(tied_model)})
    out = export_hf(ckpt, str(tmp_path / "hf"))
    with open(f"{out}/config.json") as f:
        assert json.load(f)["model_type"] == "qwen3"  # the tied Qwen3's config, not SmolLM2's llama
    assert os.path.exists(f"{out}/generation_config.json")
    with open(os.path.join(ckpt, "trainer_state.json"), "w") as f:
        json.dump({"step": 1}, f)
    with pytest.raises(ValueError, match="pass --model PATH"):
        export_hf(ckpt, str(tmp_path / "hf2"))


def test_export_writes_the_run_dtype_or_the_one_asked(learner, tied_model, tmp_path):
    """The export is in the run's model.dtype as the checkpoint records it (float32 master weights cast), or in
    --dtype; config.json says which; transformers loads it with that dtype and the same values (to the cast)."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rayrl import checkpoint
    from rayrl.export import export_hf

    tmp = checkpoint.begin(str(tmp_path / "run"), 1)
    learner.save(tmp)
    ckpt = checkpoint.commit(tmp, 1, {"step": 1, "model_path": checkpoint.base_model(tied_model), "dtype": "bfloat16"})
    for out, want, name, code in ((export_hf(ckpt, str(tmp_path / "run_dtype")), torch.bfloat16, "bfloat16", "BF16"),
                                  (export_hf(ckpt, str(tmp_path / "asked"), dtype="float16"), torch.float16,
                                   "float16", "F16")):
        with safe_open(f"{out}/model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {code}  # safetensors' dtype codes
        with open(f"{out}/config.json") as f:
            assert json.load(f)["dtype"] == name
        model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        assert model.dtype == want
        emb = dict(learner.model.state_dict())["model.embed_tokens.weight"]
        emb = emb.full_tensor() if hasattr(emb, "full_tensor") else emb
        assert torch.equal(model.model.embed_tokens.weight, emb.detach().to(want))
    with pytest.raises(ValueError, match="dtype='int8'"):
        export_hf(ckpt, str(tmp_path / "bad"), dtype="int8")
