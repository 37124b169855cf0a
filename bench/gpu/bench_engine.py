"""GPU benchmarks of rayrl's Engine and Learner against their physical or vLLM peers, one ratio per run.

    python bench/gpu/bench_engine.py all --out DIR      # every part below, each in its own process
    python bench/gpu/bench_engine.py ceil|vllm|engine|sync05|learner --out DIR

Parts (each appends one JSON line to DIR/bench.jsonl and prints a table line):
- ceil:   the card's two ceilings: device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul.
- vllm:   vLLM's own offline `LLM.generate` on the prompts below (the peer).
- engine: rayrl's `Engine` (vllm backend, AsyncLLM, one request per sample) on the same prompts and sampling;
          then with a `Learner` (FSDP2, nccl) on the same GPU: weight sync learner -> engine through rayrl's
          strategies (rayrl/weight_sync/) object_store and cuda_ipc (`Learner.send_weights` ->
          `Engine.receive_weights`), each against a device-to-device copy of the same bytes;
          engine-vs-learner logprob agreement after each sync.
- sync05: the same two syncs for a random-init Qwen2.5-0.5B-shaped model (untied lm_head).
- syncseed --shape qwen3-4b:tied|qwen2.5-7b:-: cuda_ipc alone on a seed shape (bench_seed.model_dir), the buffer
          kept open (engines awake) and per sync (sleeping engines: opened, loaded, closed, freed by the learner's
          offload), each after an optimizer step (--optimizer-offload: AdamW state in CPU memory between steps;
          --sleep-level N: the engine asleep during the step, as a colocated job, for shapes whose step does not fit
          beside an awake engine: Qwen2.5-7B).
- learner: the learner's training throughput / MFU on that model: padding-free packed rows (varlen flash
          attention, rayrl/attention.py), eager or with learner.compile at token budgets (--variants); profiles
          (GPU time by kernel kind, ops by input shape, a chrome trace).
- attn:   attention alone on one packed micro-batch: torch's varlen flash kernel vs cuDNN's ragged attention.
- summary TRACE: `trace_summary` of a stored chrome trace (no GPU needed).

Prompts: reasoning-gym basic_arithmetic (rayrl's default job data) through SmolLM2's chat template, 1024 prompts
n=1 and 128 prompts x n=8, 256 new tokens, temperature 1, the sampled token's logprob.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import torch

PEAK_BF16 = 989.4e12  # H200 SXM dense bf16, datasheet
OUT = "."
SYNC_LR = 2e-4  # large enough that one Adam step moves bf16 weights (1e-5 is below a bf16 ulp of most weights)


def emit(part: str, **kv) -> None:
    kv = {"part": part, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **kv}
    with open(os.path.join(OUT, "bench.jsonl"), "a") as f:
        f.write(json.dumps(kv) + "\n")
    print("BENCH", json.dumps(kv), flush=True)


def d2d_seconds(nbytes: int, reps: int = 20) -> float:
    """Median seconds of one device-to-device copy of nbytes (random data)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ts = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return sorted(ts)[len(ts) // 2]


def prompts(model_path: str, count: int, seed: int = 7) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rayrl.config import DataConfig
    from rayrl.data import load_rows

    d = DataConfig()
    tok = AutoTokenizer.from_pretrained(model_path)
    rows = load_rows(d.source, count, seed, d.gym_kwargs, d.system_prompt)
    return [tok.encode(tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False) for r in rows]


# --- parts -----------------------------------------------------------------------------------------

def part_ceil(args) -> None:
    n = 4 << 30
    t = d2d_seconds(n, 10)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    tflops = 10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12
    emit("ceil", d2d_TBps=2 * n / t / 1e12, matmul_bf16_TFLOPs=tflops, gpu=torch.cuda.get_device_name())


def _sampling_kw(args):
    return dict(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, logprobs=0)


def _engine_args(args) -> dict:
    return dict(dtype="bfloat16", seed=0, max_model_len=1024, enforce_eager=args.eager, max_num_seqs=args.max_num_seqs,
                enable_prefix_caching=True, gpu_memory_utilization=args.gpu_mem, max_logprobs=1)


def part_vllm(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rayrl.models import resolve_model

    path = resolve_model("smollm2")
    ps = prompts(path, 1024)
    t0 = time.perf_counter()
    llm = LLM(model=path, **_engine_args(args))
    start_s = time.perf_counter() - t0
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[:64]], SamplingParams(**_sampling_kw(args)),
                 use_tqdm=False)
    res = {}
    for name, sub, n in (("1024x1", ps, 1), ("128x8", ps[:128], 8)):
        sp = SamplingParams(n=n, **_sampling_kw(args))
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in sub], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
        res[name] = {"tokens": toks, "seconds": dt, "tok_s": toks / dt}
    emit("vllm", start_s=start_s, prompt_len_mean=sum(map(len, ps)) / len(ps), eager=args.eager,
         max_num_seqs=args.max_num_seqs, **{f"{k}_{m}": v for k, r in res.items() for m, v in r.items()})
    del llm


def _learner(model_path: str, lr: float, micro: int = 8, pack: bool = True, budget: int = 0, compile: bool = False,
             layer_dynamic: bool | None = None):
    from rayrl.config import load_config
    from rayrl.learner import Learner

    cfg = load_config(None, [f"model.path={model_path}", "model.dtype=bfloat16", "learner.gpus_per_worker=1",
                             f"learner.lr={lr}", f"learner.micro_batch_size={micro}", "data.max_prompt_length=256",
                             "rollout.max_response_length=768", f"learner.pack={pack}",
                             f"learner.max_tokens_per_micro_batch={budget}", f"learner.compile={compile}"],
                      check_files=False)
    ln = Learner(model_path, cfg, layer_dynamic=layer_dynamic)
    t0 = time.perf_counter()
    nparams = ln.setup()
    return ln, nparams, time.perf_counter() - t0


def _batch(prompt_ids, response_ids, adv=None):
    from rayrl.types import TrainBatch

    masks = [[1] * len(r) for r in response_ids]
    advs = [[(adv[i] if adv else 0.0)] * len(r) for i, r in enumerate(response_ids)]
    return TrainBatch(prompt_ids=[list(p) for p in prompt_ids], response_ids=[list(r) for r in response_ids],
                      loss_mask=masks, advantages=advs, global_tokens=sum(map(len, masks)), global_seqs=len(masks))


async def _gen_all(eng, ps, max_tokens, n=1):
    from rayrl.engine import Sampling

    s = Sampling(max_tokens=max_tokens, temperature=1.0)
    return await asyncio.gather(*[eng.generate(p, s) for p in ps for _ in range(n)])


async def logprob_agreement(eng, ln, ps) -> dict:
    """Engine samples; the learner scores the same tokens. Max/mean abs diff of the sampled tokens' logprobs."""
    gens = await _gen_all(eng, ps, 64)
    gens = [g for g in gens if g.token_ids]
    lp = ln.compute_logprobs(_batch([g.prompt_ids for g in gens], [g.token_ids for g in gens]))
    d = [abs(a - b) for g, lps in zip(gens, lp, strict=True) for a, b in zip(g.logprobs, lps, strict=True)]
    return {"max_abs": max(d), "mean_abs": sum(d) / len(d), "tokens": len(d)}


async def ipc_sync(ln, eng, version: int) -> dict:
    """rayrl's cuda_ipc strategy: the learner copies its weights into its persistent GPU buffer, the engine worker
    loads from views of it (the IPC handle is opened on the first sync only, then cached)."""
    t0 = time.perf_counter()
    handle = ln.send_weights("cuda_ipc", version)
    t1 = time.perf_counter()
    await eng.receive_weights("cuda_ipc", handle, version)
    t2 = time.perf_counter()
    return {"copy_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0, "bytes": ln._senders["cuda_ipc"].buf.numel(),
            "buffer_id": handle.buffer_id,
            "worker_load": eng._receivers["cuda_ipc"].loads}


async def rayrl_sync(ln, eng, version: int) -> dict:
    """rayrl's object_store strategy: full state to CPU on the learner, a safetensors file in /dev/shm, reload."""
    t0 = time.perf_counter()
    packet = ln.send_weights("object_store", version)
    t1 = time.perf_counter()
    upd = await eng.receive_weights("object_store", packet, version)
    return {"weights_s": t1 - t0, "update_s": upd, "total_s": time.perf_counter() - t0, "bytes": packet.nbytes}


async def sync_suite(ln, eng, ps, tag: str, reps: int = 6) -> None:
    """rayrl's object_store and cuda_ipc strategies, each after a real optimizer step (so the weights differ), with
    logprob agreement. The first run of each is reported apart (cuda_ipc allocates its buffer and opens the
    handle then); the median is over the later, steady-state runs."""
    out = {"model": tag}
    gens = [g for g in await _gen_all(eng, ps[:64], 64) if g.token_ids]
    step_batch = _batch([g.prompt_ids for g in gens], [g.token_ids for g in gens],
                        adv=[1.0 if i % 2 else -1.0 for i in range(len(gens))])
    for path, fn in (("object_store", rayrl_sync), ("cuda_ipc", ipc_sync)):
        ts = []
        for r in range(reps):
            ln.train_step(step_batch)
            if r == 0:
                out[f"{path}_stale_logprob"] = await logprob_agreement(eng, ln, ps[:32])
            ts.append(await fn(ln, eng, 100 + r))
        out[f"{path}_logprob"] = await logprob_agreement(eng, ln, ps[:32])
        out[f"{path}_runs"] = ts
        steady = sorted(t["total_s"] for t in ts[1:])  # the first run sets up (cuda_ipc: buffer + handle)
        out[f"{path}_first_s"] = ts[0]["total_s"]
        out[f"{path}_total_s_median"] = steady[len(steady) // 2]
    nbytes = out["cuda_ipc_runs"][0]["bytes"]
    out["d2d_copy_s"] = d2d_seconds(nbytes)
    out["bytes"] = nbytes
    for path in ("object_store", "cuda_ipc"):
        out[f"{path}_over_d2d"] = out[f"{path}_total_s_median"] / out["d2d_copy_s"]
    emit("sync", **out)


async def _engine(path, args):
    from rayrl.config import EngineConfig
    from rayrl.engine import Engine

    cfg = EngineConfig(backend="vllm", gpus_per_engine=1, max_model_len=1024, gpu_memory_utilization=args.gpu_mem,
                       enforce_eager=args.eager, max_num_seqs=args.max_num_seqs,
                       sleep_level=getattr(args, "sleep_level", 0))
    eng = Engine(path, cfg, dtype="bfloat16", seed=0)
    t0 = time.perf_counter()
    await eng.start()
    return eng, time.perf_counter() - t0


async def part_engine(args) -> None:
    from rayrl.models import resolve_model

    path = resolve_model("smollm2")
    ps = prompts(path, 1024)
    eng, start_s = await _engine(path, args)
    await _gen_all(eng, ps[:64], args.max_tokens)
    res = {}
    for name, sub, n in (("1024x1", ps, 1), ("128x8", ps[:128], 8)):
        t0 = time.perf_counter()
        gens = await _gen_all(eng, sub, args.max_tokens, n)
        dt = time.perf_counter() - t0
        toks = sum(len(g.token_ids) for g in gens)
        res[name] = {"tokens": toks, "seconds": dt, "tok_s": toks / dt}
    emit("engine", start_s=start_s, eager=args.eager, max_num_seqs=args.max_num_seqs,
         **{f"{k}_{m}": v for k, r in res.items() for m, v in r.items()})
    if not args.no_sync:
        ln, nparams, setup_s = _learner(path, lr=SYNC_LR)
        await sync_suite(ln, eng, ps, "SmolLM2-135M")
        ln.shutdown()
    await eng.shutdown()


def make_qwen05(target: str, tok_from: str) -> str:
    """A random-init Qwen2.5-0.5B-shaped model (untied lm_head: rayrl's engines reload lm_head separately)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(target, "config.json")):
        return target
    tok = AutoTokenizer.from_pretrained(tok_from)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1e6,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    return target


def train_throughput(ln, lengths: list[int], prompt_len: int, vocab: int, steps: int = 3, profile: str = "",
                     dead: int = 0) -> dict:
    """Optimizer steps on sequences of the given lengths (random tokens; advantages +-1, the first `dead` sequences'
    0); FLOPs of the work each token needs: every weight matrix at every position except the lm_head, which only the
    response-predicting positions need (the packed path computes it there only), plus causal attention within each
    sequence."""
    vocab = min(vocab, ln.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    b = _batch([s[:prompt_len] for s in ids], [s[prompt_len:] for s in ids],
               adv=[0.0 if i < dead else 1.0 if i % 2 else -1.0 for i in range(len(ids))])
    cuda = torch.cuda.is_available()
    w0 = time.perf_counter()
    ln.train_step(b)  # warm-up (and, with learner.compile, the compilation)
    warmup_s = time.perf_counter() - w0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        ln.train_step(b)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    m = ln.model.config
    named = dict(ln.model.named_parameters())  # a tied lm_head is listed once, as the embedding
    head = ln.model.lm_head.weight.numel()
    body = sum(p.numel() for n, p in named.items() if "embed_tokens" not in n and n != "lm_head.weight")
    tokens = sum(lengths)
    predicted = sum(n - prompt_len for n in lengths)
    # causal: half of 12 L d n^2, d the attention's width (heads x head_dim: 4096 in Qwen3-4B, whose hidden size is
    # 2560; counted as the hidden size before 2026-12-05, which left a third of the 4B's attention FLOPs out)
    d_attn = m.num_attention_heads * (getattr(m, "head_dim", None) or m.hidden_size // m.num_attention_heads)
    attn = sum(6 * m.num_hidden_layers * d_attn * n * n for n in lengths)
    flops = 6 * body * tokens + 6 * head * predicted + attn
    kinds = profile_step(ln, b, profile) if profile and cuda else None  # where the GPU time goes, how busy it is
    lc = ln.cfg.learner
    return {"seqs": len(lengths), "tokens": tokens, "len_min": min(lengths), "len_max": max(lengths),
            "pack": lc.pack, "compile": ln.compiled, "max_tokens_per_micro_batch": lc.max_tokens_per_micro_batch,
            "micro_batch": lc.micro_batch_size, "attn": ln.model.config._attn_implementation, "step_s": dt,
            "warmup_s": warmup_s, "tok_s": tokens / dt, "tflops": flops / dt / 1e12, "mfu": flops / dt / PEAK_BF16,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "flops_per_step": flops, "params_body": body, "params_lm_head": head, "profile_ms": kinds}


KERNEL_KINDS = (("attention_fwd", ("flash_fwd", "cudnn_fwd", "fmha_fwd", "fprop")), ("attention_bwd", ("flash_bwd",
                "cudnn_bwd", "fmha_bwd", "dgrad", "bprop")), ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
                ("memcpy", ("Memcpy",)), ("memset", ("Memset",)), ("nccl", ("nccl",)), ("triton", ("triton_",)),
                ("aten_elementwise", ("elementwise_kernel", "CatArray", "reduce_kernel", "index", "scatter")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k.lower() in low for k in keys)), "other")


def profile_step(ln, b, name: str) -> dict:
    """One more step under the profiler. Writes OUT/name.json.gz (a chrome trace) and OUT/name (`trace_summary`, then
    the top ops by input shape: what the copies copy). Returns the kind totals (ms) and the idle time."""
    import gzip

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        t1 = time.perf_counter()
        ln.train_step(b)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t1
    path = os.path.join(OUT, name)
    p.export_chrome_trace(path + ".json")
    with open(path + ".json") as f:
        trace = json.load(f)["traceEvents"]
    with gzip.open(path + ".json.gz", "wt") as f:
        json.dump({"traceEvents": trace}, f)
    os.remove(path + ".json")
    text, totals = trace_summary(trace)
    with open(path, "w") as f:
        f.write(f"step wall {wall * 1e3:.0f} ms; {text}\nops by input shape (self GPU time):\n")
        f.write(p.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=40,
                                                                 max_name_column_width=50, max_shapes_column_width=90))
    print(f"profile: step {wall:.3f} s, {totals} -> {path}", flush=True)
    return totals


def trace_summary(trace: list[dict]) -> tuple[str, dict]:
    """From a chrome trace's events: GPU time by kernel kind, how long the GPU sat idle (gaps > 50 us between kernels)
    and which CPU op launched the kernel after each gap (through the runtime or driver call with the kernel's
    correlation id), and the top kernels. `python bench_engine.py summary TRACE.json.gz` reads a stored one."""
    from collections import defaultdict

    kernels = sorted((e for e in trace
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    kinds: dict = defaultdict(lambda: [0.0, 0])
    top: dict = defaultdict(float)
    for e in kernels:
        kinds[kernel_kind(e["name"])][0] += e["dur"] / 1e3
        kinds[kernel_kind(e["name"])][1] += 1
        top[e["name"][:120]] += e["dur"] / 1e3
    launches = {e["args"].get("correlation"): e for e in trace
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ops = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    blame: dict = defaultdict(float)
    end, idle = kernels[0]["ts"], 0.0
    for e in kernels:
        gap = e["ts"] - end
        if gap > 50:  # us
            idle += gap
            r = launches.get(e.get("args", {}).get("correlation"))
            around = sorted((o for o in ops
                             if r and o.get("tid") == r.get("tid") and o["ts"] <= r["ts"] <= o["ts"] + o["dur"]),
                            key=lambda o: o["dur"])
            blame[" < ".join(o["name"][:48] for o in around[:3]) or "(launch not found)"] += gap / 1e3
        end = max(end, e["ts"] + e["dur"])
    span = (end - kernels[0]["ts"]) / 1e3
    busy = sum(v[0] for v in kinds.values())
    lines = [f"kernels from first to last {span:.0f} ms, of which kernels ran {busy:.0f} ms and the GPU sat idle "
             f"{idle / 1e3:.0f} ms in gaps > 50 us", "", "ms by kernel kind:"]
    lines += [f"  {kind:18s} {ms:8.1f} ms {n:6d} kernels"
              for kind, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])]
    lines += ["", "idle before kernels launched by (innermost CPU ops):"]
    lines += [f"  {ms:7.1f} ms  {k}" for k, ms in sorted(blame.items(), key=lambda kv: -kv[1])[:15]]
    lines += ["", "top kernels:"]
    lines += [f"  {ms:7.1f} ms  {k}" for k, ms in sorted(top.items(), key=lambda kv: -kv[1])[:30]]
    return "\n".join(lines) + "\n", {**{kind: round(v[0], 1) for kind, v in kinds.items()},
                                     "idle": round(idle / 1e3, 1)}


def bench_lengths() -> list[int]:
    """The learner and attn parts' 64 sequence lengths, 512-4096 tokens (seed 1)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(512, 4097, (64,), generator=g).tolist()


async def part_sync05(args) -> None:
    from rayrl.models import resolve_model

    small = resolve_model("smollm2")
    path = make_qwen05("/tmp/rayrl-cache/qwen05-shape", small)
    ps = prompts(small, 64)
    ln, nparams, setup_s = _learner(path, lr=SYNC_LR)
    args.eager = True  # sync figures do not depend on CUDA graphs; skip their capture for a new model
    eng, start_s = await _engine(path, args)
    await sync_suite(ln, eng, ps, "Qwen2.5-0.5B-shape(random)")
    await eng.shutdown()
    ln.shutdown()


async def part_syncseed(args) -> None:
    """cuda_ipc on a seed shape: steady-state seconds with the buffer kept open, then with a buffer per sync (what a
    job with engine.sleep_level uses), and the engine-vs-learner logprob gap after each mode's last sync."""
    from bench_seed import model_dir

    from rayrl.config import load_config
    from rayrl.learner import Learner

    shape, tie = args.shape.split(":")
    path = model_dir(shape, tie)
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"learner.lr={SYNC_LR}",
                             f"learner.optimizer_offload={args.optimizer_offload}", "engine.gpus_per_engine=0.5",
                             "learner.gpus_per_worker=0.5", "data.max_prompt_length=256",
                             "rollout.max_response_length=768"], check_files=False)
    ln = Learner(path, cfg)
    nparams = ln.setup()
    args.eager = True
    eng, start_s = await _engine(path, args)
    ps = prompts(path, 32)
    gens = [g for g in await _gen_all(eng, ps, 32) if g.token_ids]
    batch = _batch([g.prompt_ids for g in gens], [g.token_ids for g in gens],
                   adv=[1.0 if i % 2 else -1.0 for i in range(len(gens))])
    sender = ln._senders["cuda_ipc"]
    out = {"model": f"{shape}:{tie}", "params": nparams, "engine_start_s": start_s}
    for mode, keep_open in (("kept_open", True), ("per_sync", False)):
        sender.keep_open = keep_open  # what engine.sleep_level sets at construction (0: kept open)
        if not keep_open:
            sender.release()
        if args.sleep_level and keep_open:
            continue  # beside a sleeping engine the buffer lives for the sync only (what colocated jobs do)
        runs = []
        for r in range(args.reps):
            if args.sleep_level:  # as rayrl.colocate: the engine frees the GPU for the update, then takes it back
                await eng.sleep(args.sleep_level)
            ln.train_step(batch)
            if args.sleep_level:
                await eng.wake_up(["weights"])
            run = await ipc_sync(ln, eng, 100 + r + (0 if keep_open else 50))
            t0 = time.perf_counter()
            ln.offload()  # per_sync: frees the buffer the engine closed (no parameter offload here)
            run["release_s"] = time.perf_counter() - t0
            if args.sleep_level:
                await eng.wake_up(["kv_cache"])
            run["allocated_gib_after"] = torch.cuda.memory_allocated() / 2**30
            runs.append(run)
        steady = sorted(x["total_s"] for x in runs[1:])
        out[f"{mode}_runs"] = runs
        out[f"{mode}_total_s_median"] = steady[len(steady) // 2]
        out[f"{mode}_logprob"] = await logprob_agreement(eng, ln, ps[:16])
    out["bytes"] = out["per_sync_runs"][0]["bytes"]
    out["d2d_copy_s"] = d2d_seconds(out["bytes"])
    emit("syncseed", **out)
    await eng.shutdown()
    ln.shutdown()


def part_learner(args) -> None:
    """Learner throughput / MFU on the 0.5B shape: 64 sequences of 512-4096 tokens (prompt 256) in padding-free
    packed rows (varlen flash attention), eager or with learner.compile at the --variants' token budgets, each
    variant a new Learner; those with a file name are profiled (profile_step). --label records which code ran
    (a baseline is the same bench with an older rayrl first on PYTHONPATH)."""
    from rayrl.models import resolve_model

    path = make_qwen05("/tmp/rayrl-cache/qwen05-shape", resolve_model("smollm2"))
    lengths = bench_lengths()
    from rayrl import attention

    # eager | compile | compile-dynamic (every size symbolic) | compile-repeat (kv heads repeated) : budget [: profile]
    variants = [v.split(":") for v in args.variants.split(",")]
    for kind, budget, *prof in variants:
        compiled, budget = kind.startswith("compile"), int(budget)
        try:
            ln, nparams, _ = _learner(path, lr=1e-6, micro=4, pack=True, budget=budget, compile=compiled,
                                      layer_dynamic=True if kind == "compile-dynamic" else None)
            if kind == "compile-repeat":
                attention.GQA_IN_KERNEL = False
            gqa = attention.GQA_IN_KERNEL
            emit("learner", model="Qwen2.5-0.5B-shape(random)", params=nparams, code=args.label, variant=kind,
                 gqa_in_kernel=gqa, **train_throughput(ln, lengths, 256, 151936, profile=(prof or [""])[0]))
            ln.shutdown()
            del ln
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - report and go on
            emit("learner", model="Qwen2.5-0.5B-shape", code=args.label, variant=kind, error=repr(e)[:600],
                 budget=budget)


def part_attn(args) -> None:
    """Attention alone, on the learner part's first 32k-token packed micro-batch (0.5B shape: 14 query heads, 2 kv
    heads, head dim 64, causal per sequence), forward + backward, each against the first: torch's varlen flash kernel
    with the kv heads repeated (the learner before), the same kernel given the 2 kv heads (what `register` checks
    and the learner now does where it works), and cuDNN's ragged attention through aten._cudnn_attention_forward /
    backward (torch's own varlen_attn keeps that path switched off). ms per call, TFLOP/s, largest differences."""
    from rayrl import attention
    from rayrl.batching import token_budget_bins

    lengths = bench_lengths()
    lens = [lengths[i] for i in token_budget_bins(lengths, 32768)[0]]
    T, hq, hkv, d = sum(lens), 14, 2, 64
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lens)
    torch.manual_seed(0)
    q, k, v, go = (torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    flops = sum(4 * n * n * d * hq / 2 for n in lens) * 3.5  # causal: forward 1x, backward 2.5x

    def run(native):
        def fn():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            kv = (kk, vv) if native else (kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1))
            out = attention._flash(qq, *kv, cu, longest, None, native)
            out.backward(go)
            return out, qq.grad, kk.grad, vv.grad
        return fn

    def cudnn():
        kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
        res = torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, longest, longest, True, 0.0, True,
                                                      False, scale=None)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(go, q, kk, vv, out, lse, seed, offset,
                                                              torch.empty(0, device="cuda"), cu, cu, longest,
                                                              longest, 0.0, True, scale=None)
        return out, dq, dk.view(T, hkv, -1, d).sum(2), dv.view(T, hkv, -1, d).sum(2)

    def timed(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        for _ in range(reps):
            fn()
        s1.record()
        torch.cuda.synchronize()
        return s0.elapsed_time(s1) / reps

    ref = run(False)()
    res = {"tokens": T, "seqs": len(lens), "register_says_gqa_in_kernel": attention.kernel_takes_gqa()}
    for name, fn in (("flash_repeat", run(False)), ("flash_gqa", run(True)), ("cudnn", cudnn)):
        try:
            got = fn()
            res[name + "_rel_diff"] = {n: ((a.float() - b.float()).norm() / b.float().norm()).item()
                                       for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)}
            res[name + "_ms"] = timed(fn)
            res[name + "_tflops"] = flops / res[name + "_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 - report and go on
            res[name + "_error"] = repr(e)[:300]
    emit("attn", **res)


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["all", "ceil", "vllm", "engine", "sync05", "syncseed", "learner", "attn",
                                           "summary"])
    ap.add_argument("trace", nargs="?", help="summary: a chrome trace (.json or .json.gz) that profile_step wrote")
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs) for both vLLM and Engine")
    ap.add_argument("--no-sync", action="store_true")
    ap.add_argument("--shape", default="qwen3-4b:tied", help="syncseed: SHAPE:TIE as in bench_seed.py")
    ap.add_argument("--reps", type=int, default=5, help="syncseed: syncs per mode (the first is reported apart)")
    ap.add_argument("--optimizer-offload", action="store_true", help="syncseed: AdamW state in CPU memory")
    ap.add_argument("--sleep-level", type=int, default=0,
                    help="syncseed: the engine sleeps (vLLM sleep mode, this level) around each optimizer step and "
                         "wakes its weights for the sync, as colocated jobs do (then only the per-sync buffer runs)")
    ap.add_argument("--variants", default="eager:32768,compile:32768:learner_profile.txt,compile:49152",
                    help="learner: eager|compile|compile-dynamic|compile-repeat:token budget[:profile file], "
                         "comma-separated")
    ap.add_argument("--label", default="HEAD", help="learner: which code ran (recorded in bench.jsonl)")
    ap.add_argument("--timeout", type=float, default=300, help="per part, when running all")
    ap.add_argument("--parts", default="ceil,vllm,engine,sync05,learner", help="which parts 'all' runs, in order")
    args = ap.parse_args()
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    if args.part == "all":
        rest = [a for a in sys.argv[2:]]
        for p in args.parts.split(","):
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, __file__, p, *rest], start_new_session=True)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:  # the whole group: vLLM's engine-core process too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
            print(f"bench part {p}: rc={rc} in {time.perf_counter() - t0:.0f}s", flush=True)
        return 0
    if args.part == "ceil":
        part_ceil(args)
    elif args.part == "vllm":
        part_vllm(args)
    elif args.part == "learner":
        part_learner(args)
    elif args.part == "attn":
        part_attn(args)
    elif args.part == "summary":
        import gzip

        with (gzip.open if args.trace.endswith(".gz") else open)(args.trace, "rt") as f:
            print(trace_summary(json.load(f)["traceEvents"])[0])
    else:
        asyncio.run({"engine": part_engine, "sync05": part_sync05, "syncseed": part_syncseed}[args.part](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
