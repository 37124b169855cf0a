"""Every job file in jobs/ loads and validates (files and model folders are not checked: they live elsewhere), and the
two ReTool jobs equal the scripts they reproduce, knob by knob: seed 001's
run_qwen3-4b-instruct_dapo_e2b_code_tool.sh (+ e2b_code_tool_config.yaml) and verl v0.6.1's
recipe/retool/run_qwen2_7b_dapo.sh (+ sandbox_fusion_tool_config.yaml). The tables below are the scripts' values
written out in rayrl's fields, each with the script line it comes from."""

from __future__ import annotations

import glob
import os
import re

import pytest

from rayrl.agents.tool_agent import Settings, load_tools
from rayrl.config import load_config

JOBS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "jobs")
JOBS = sorted(glob.glob(os.path.join(JOBS_DIR, "*.yaml")))
LAYOUT = "layout"  # a GPU-layout knob rayrl writes its own way (Ray GPU fractions, no vLLM TP): documented in the job

# Seed 001 (../shared/seeds/001_*): the script's variables and flags, then e2b_code_tool_config.yaml.
SEED_001 = [
    ("model.path", "/home/tione/notebook/models/Qwen3-4B-Instruct-2507",
     "model_path=/home/tione/notebook/models/Qwen3-4B-Instruct-2507"),
    ("data.source", "/home/tione/notebook/data/dapo_math_17k.parquet",
     "dapo_math_17k=$DATA_ROOT/BytedTsinghua-SIA/DAPO-Math-17k_processed; train_files=\"['$dapo_math_17k']\" "
     "(prepared by rayrl.prepare dapo-math --keep-duplicates)"),
    ("data.val_source", ["/home/tione/notebook/data/aime_2024.parquet"],
     "aime_2024=$DATA_ROOT/Maxwell-Jia/AIME_2024; test_files=\"['$aime_2024']\" (rayrl.prepare aime2024)"),
    ("data.system_prompt", None, "custom_cls CustomRLHFDataset: one user message, no system message"),
    ("trainer.project_name", "e2b_code_retool", "project_name=e2b_code_retool"),
    ("trainer.experiment_name", "qwen3-4b_dapo", "experiment_name=qwen3-4b_dapo"),
    ("trainer.output_dir", "/home/tione/notebook/checkpoint/qwen3-4b_dapo",
     "default_local_dir=/home/tione/notebook/checkpoint/$experiment_name"),
    ("algo.adv_estimator", "grpo", "adv_estimator=grpo"),
    ("algo.use_kl_loss", False, "use_kl_loss=False (kl_loss_coef=0.0; use_kl_in_reward=False, kl_coef=0.0)"),
    ("algo.clip_ratio_low", 0.2, "clip_ratio_low=0.2"),
    ("algo.clip_ratio_high", 0.28, "clip_ratio_high=0.28"),
    ("algo.clip_ratio_c", 10.0, "actor_rollout_ref.actor.clip_ratio_c=10.0"),
    ("algo.loss_agg_mode", "token-mean", "actor.loss_agg_mode (verl default token-mean)"),
    ("rollout.agent_config.max_turns", 8, "max_turns=8; multi_turn.max_user_turns/max_assistant_turns=$max_turns"),
    ("data.max_prompt_length", 2048, "max_prompt_length=2048"),
    ("rollout.max_response_length", 16384, "max_response_length=16384"),
    ("learner.lr", 1e-6, "actor_lr=1e-6"),
    ("trainer.batch_size", 128, "train_batch_size=128"),
    ("learner.mini_batch_size", 32, "ppo_mini_batch_size=32"),
    ("rollout.n", 8, "n_resp_per_prompt=8"),
    ("trainer.val_n", 30, "n_resp_per_prompt_val=30"),
    ("learner.max_tokens_per_micro_batch", 18432,
     "actor_max_token_len_per_gpu=$(( (max_prompt_length + max_response_length) * 1 )); use_dynamic_bsz=True"),
    ("reward.fn", "retool", "custom_reward_function.path=recipe/retool/retool.py, name=compute_score"),
    ("model.gradient_checkpointing", True, "actor_rollout_ref.model.enable_gradient_checkpointing=True"),
    ("learner.pack", True, "actor_rollout_ref.model.use_remove_padding=True"),
    ("rollout.agent", "rayrl.agents.tool_agent:agent", "rollout.multi_turn.enable=True, format=hermes, tool agent"),
    ("rollout.temperature", 1.0, "actor_rollout_ref.rollout.temperature (verl default 1.0)"),
    ("rollout.top_p", 1.0, "actor_rollout_ref.rollout.top_p (verl default 1)"),
    ("trainer.val_top_p", 0.6, "actor_rollout_ref.rollout.val_kwargs.top_p=0.6"),
    ("trainer.val_temperature", 1.0, "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"),
    ("trainer.logger", ["console", "tensorboard"], "trainer.logger=['console','tensorboard']"),
    ("trainer.val_before_train", True, "trainer.val_before_train=True"),
    ("trainer.log_val_generations", 100, "trainer.log_val_generations=100"),
    ("trainer.save_freq", 30, "trainer.save_freq=30"),
    ("trainer.test_freq", 5, "trainer.test_freq=5"),
    ("trainer.total_steps", 1791700 // 128, "trainer.total_epochs=1: DAPO-Math-17k's 1,791,700 rows, drop_last"),
    ("learner.weight_decay", 0.01, "actor.optim.weight_decay (verl default 0.01)"),
    ("learner.grad_clip", 1.0, "actor.optim.clip_grad (verl default 1.0)"),
    ("learner.ppo_epochs", 1, "actor.ppo_epochs (verl default 1)"),
    ("algo.norm_adv_by_std_in_grpo", True, "algorithm.norm_adv_by_std_in_grpo (verl default True)"),
    ("algo.entropy_coeff", 0.0, "actor.entropy_coeff (verl default 0)"),
    ("reward.overlong_buffer_len", 0, "reward_model.reward_manager (verl default naive): no overlong penalty"),
    ("rollout.agent_config.max_parallel_calls", 1, "multi_turn.max_parallel_calls (verl default 1)"),
    ("rollout.agent_config.max_tool_response_length", 256, "multi_turn.max_tool_response_length (verl default 256)"),
    ("rollout.agent_config.tool_response_truncate_side", "middle",
     "multi_turn.tool_response_truncate_side (verl default middle)"),
    ("rollout.agent_config.system_prompt", None, "the recipe's tool agent adds no system prompt"),
    ("rollout.agent_config.tools", [{"builtin": "code_interpreter"}],
     "tool_schema: code_interpreter, 'A tool for executing code.', {code: string}, required [code]"),
    ("sandbox.backend", "e2b", "class_name: verl.tools.e2b_code_tool.E2BCodeTool"),
    ("sandbox.e2b_domain", "ap-shanghai.tencentags.com", "e2b_domain: ap-shanghai.tencentags.com"),
    ("sandbox.e2b_template", "code-interpreter-v1", "e2b_template: code-interpreter-v1"),
    ("sandbox.sandbox_timeout", 300, "sandbox_timeout: 300"),
    ("sandbox.timeout", 30.0, "default_timeout: 30"),
    ("engine.backend", "vllm", "actor_rollout_ref.rollout.name=vllm, mode=async"),
    ("engine.max_model_len", 18432, "prompt_length + response_length (vLLM's max_model_len)"),
    ("engine.num_engines", 4, f"{LAYOUT}: GPUS_PER_NODE=4, infer_tp=1: 4 vLLM replicas on the 4 GPUs"),
    ("engine.gpus_per_engine", 1, f"{LAYOUT}: infer_tp=1 (colocated with the learner ranks)"),
    ("engine.gpu_memory_utilization", 0.9, f"{LAYOUT}: rollout.gpu_memory_utilization=0.9"),
    ("learner.num_workers", 4, f"{LAYOUT}: NNODES=1, GPUS_PER_NODE=4 (FSDP over every GPU)"),
    ("learner.gpus_per_worker", 1, f"{LAYOUT}: one rank per GPU (colocated with an engine)"),
    ("learner.sequence_parallel", 4, f"{LAYOUT}: train_sp=4; actor.ulysses_sequence_parallel_size=$train_sp"),
    ("learner.param_offload", True, f"{LAYOUT}: offload=True; fsdp_config.param_offload=$offload"),
    ("learner.optimizer_offload", True, f"{LAYOUT}: offload=True; fsdp_config.optimizer_offload=$offload"),
]

# verl v0.6.1 recipe/retool/run_qwen2_7b_dapo.sh, then sandbox_fusion_tool_config.yaml.
RECIPE_7B = [
    ("model.path", "checkpoint/multiturn-sft-qwen-2.5-7b-instruct/global_step_372",
     "model_path=$HDFS_ROOT/checkpoint/multiturn-sft-qwen-2.5-7b-instruct/global_step_372 (HDFS_ROOT=$PWD)"),
    ("data.source", "dataset/dapo_math_17k.parquet",
     "dapo_math_17k=$DATA_ROOT/dataset/BytedTsinghua-SIA/DAPO-Math-17k; train_files=\"['$dapo_math_17k']\""),
    ("data.val_source", ["dataset/aime_2025.parquet", "dataset/aime_2024.parquet"],
     "test_files=\"['$aime_2025', '$aime_2024']\" (yentinglin/aime_2025, Maxwell-Jia/AIME_2024)"),
    ("data.system_prompt", None, "custom_cls CustomRLHFDataset: one user message, no system message"),
    ("trainer.project_name", "retool", "project_name=retool"),
    ("trainer.experiment_name", "qwen2.5-7b_dapo", "experiment_name=qwen2.5-7b_dapo"),
    ("trainer.output_dir", "checkpoint/qwen2.5-7b_dapo", "default_local_dir=$DATA_ROOT/checkpoint/$experiment_name"),
    ("algo.adv_estimator", "grpo", "adv_estimator=grpo"),
    ("algo.use_kl_loss", False, "use_kl_loss=False (kl_loss_coef=0.0; use_kl_in_reward=False, kl_coef=0.0)"),
    ("algo.clip_ratio_low", 0.2, "clip_ratio_low=0.2"),
    ("algo.clip_ratio_high", 0.28, "clip_ratio_high=0.28"),
    ("algo.clip_ratio_c", 10.0, "actor_rollout_ref.actor.clip_ratio_c=10.0"),
    ("algo.loss_agg_mode", "token-mean", "actor.loss_agg_mode (verl default token-mean)"),
    ("rollout.agent_config.max_turns", 16, "max_turns=16; multi_turn.max_user_turns/max_assistant_turns=$max_turns"),
    ("data.max_prompt_length", 2048, "max_prompt_length=2048"),
    ("rollout.max_response_length", 16384, "max_response_length=16384"),
    ("learner.lr", 1e-6, "actor_lr=1e-6"),
    ("trainer.batch_size", 64, "train_batch_size=64"),
    ("learner.mini_batch_size", 16, "ppo_mini_batch_size=16"),
    ("rollout.n", 16, "n_resp_per_prompt=16"),
    ("trainer.val_n", 30, "n_resp_per_prompt_val=30"),
    ("learner.max_tokens_per_micro_batch", 18432,
     "actor_max_token_len_per_gpu=$(( (max_prompt_length + max_response_length) * 1 )); use_dynamic_bsz=True"),
    ("reward.fn", "retool", "custom_reward_function.path=recipe/retool/retool.py, name=compute_score"),
    ("model.gradient_checkpointing", True, "actor_rollout_ref.model.enable_gradient_checkpointing=True"),
    ("learner.pack", True, "actor_rollout_ref.model.use_remove_padding=True"),
    ("rollout.agent", "rayrl.agents.tool_agent:agent", "rollout.multi_turn.enable=True, format=hermes, tool agent"),
    ("rollout.temperature", 1.0, "actor_rollout_ref.rollout.temperature (verl default 1.0)"),
    ("rollout.top_p", 1.0, "actor_rollout_ref.rollout.top_p (verl default 1)"),
    ("trainer.val_top_p", 0.6, "actor_rollout_ref.rollout.val_kwargs.top_p=0.6"),
    ("trainer.val_temperature", 1.0, "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"),
    ("trainer.logger", ["console", "wandb"], "trainer.logger=['console','wandb']"),
    ("trainer.val_before_train", True, "trainer.val_before_train=True"),
    ("trainer.log_val_generations", 20, "trainer.log_val_generations=20"),
    ("trainer.save_freq", 20, "trainer.save_freq=20"),
    ("trainer.test_freq", 10, "trainer.test_freq=10"),
    ("trainer.total_steps", 1791700 // 64, "trainer.total_epochs=1: DAPO-Math-17k's 1,791,700 rows, drop_last"),
    ("learner.weight_decay", 0.01, "actor.optim.weight_decay (verl default 0.01)"),
    ("learner.grad_clip", 1.0, "actor.optim.clip_grad (verl default 1.0)"),
    ("learner.ppo_epochs", 1, "actor.ppo_epochs (verl default 1)"),
    ("algo.norm_adv_by_std_in_grpo", True, "algorithm.norm_adv_by_std_in_grpo (verl default True)"),
    ("algo.entropy_coeff", 0.0, "actor.entropy_coeff (verl default 0)"),
    ("reward.overlong_buffer_len", 0, "reward_model.reward_manager (verl default naive): no overlong penalty"),
    ("rollout.agent_config.max_parallel_calls", 1, "multi_turn.max_parallel_calls (verl default 1)"),
    ("rollout.agent_config.max_tool_response_length", 256, "multi_turn.max_tool_response_length (verl default 256)"),
    ("rollout.agent_config.tool_response_truncate_side", "middle",
     "multi_turn.tool_response_truncate_side (verl default middle)"),
    ("rollout.agent_config.system_prompt", None, "the recipe's tool agent adds no system prompt"),
    ("rollout.agent_config.tools", [{"builtin": "code_interpreter"}],
     "tool_schema: code_interpreter, 'A tool for executing code.', {code: string}, required [code]"),
    ("sandbox.timeout", 30.0, "default_timeout: 30"),
    ("sandbox.memory_mb", 1024, "memory_limit_mb: 1024"),
    ("sandbox.max_concurrency", 64, "rate_limit: 128, over rollout.num_workers=2 pools"),
    ("rollout.num_workers", 2, "rate_limit: 128 = 2 rollout workers' pools x 64"),
    ("engine.backend", "vllm", "actor_rollout_ref.rollout.name=vllm, mode=async"),
    ("engine.max_model_len", 18432, "prompt_length + response_length (vLLM's max_model_len)"),
    ("engine.num_engines", 2, f"{LAYOUT}: trainer.n_gpus_per_node=8, infer_tp=4: 2 vLLM replicas of 4 GPUs"),
    ("engine.gpus_per_engine", 4, f"{LAYOUT}: infer_tp=4; rollout.tensor_model_parallel_size=$infer_tp"),
    ("engine.gpu_memory_utilization", 0.9, f"{LAYOUT}: rollout.gpu_memory_utilization=0.9"),
    ("learner.num_workers", 8, f"{LAYOUT}: trainer.nnodes=1, trainer.n_gpus_per_node=8 (FSDP over every GPU)"),
    ("learner.gpus_per_worker", 1, f"{LAYOUT}: one rank per GPU (colocated with the engines)"),
    ("learner.sequence_parallel", 4, f"{LAYOUT}: train_sp=4; actor.ulysses_sequence_parallel_size=$train_sp"),
    ("learner.param_offload", True, f"{LAYOUT}: offload=True; fsdp_config.param_offload=$offload"),
    ("learner.optimizer_offload", True, f"{LAYOUT}: offload=True; fsdp_config.optimizer_offload=$offload"),
]

SEEDS = {"retool_qwen3_4b_e2b.yaml": SEED_001, "retool_qwen2.5_7b.yaml": RECIPE_7B}
_MISSING = object()


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part, _MISSING) if isinstance(node, dict) else getattr(node, part, _MISSING)
        if node is _MISSING:
            return _MISSING
    return node


def test_there_are_jobs() -> None:
    assert any(j.endswith("retool_tiny.yaml") for j in JOBS)


@pytest.mark.parametrize("path", JOBS, ids=[os.path.basename(j) for j in JOBS])
def test_job_loads(path: str) -> None:
    cfg = load_config(path, check_files=False)
    if cfg.rollout.agent == "rayrl.agents.tool_agent:agent":  # its agent_config is checked by the agent itself
        load_tools(cfg.rollout.agent_config.get("tools"))
        Settings.of(cfg.rollout.agent_config)


@pytest.mark.parametrize("job", sorted(SEEDS))
def test_job_equals_its_script(job: str) -> None:
    cfg = load_config(os.path.join(JOBS_DIR, job), check_files=False)
    wrong = [f"{key}: job {_get(cfg, key)!r}, script {want!r} ({line})"
             for key, want, line in SEEDS[job] if LAYOUT not in line and _get(cfg, key) != want]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("job", sorted(SEEDS))
def test_layout_differences_are_documented(job: str) -> None:
    """The GPU-layout knobs may be written differently from the script, but the job file's comments must name
    each one that does."""
    path = os.path.join(JOBS_DIR, job)
    cfg = load_config(path, check_files=False)
    with open(path) as f:
        comments = " ".join(re.findall(r"#(.*)", f.read()))
    undocumented = [key for key, want, line in SEEDS[job]
                    if LAYOUT in line and _get(cfg, key) != want and key not in comments]
    assert not undocumented, f"{job}: layout knobs differing from the script without a comment: {undocumented}"
