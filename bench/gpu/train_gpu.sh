#!/usr/bin/env bash
# The default job (SmolLM2-135M-Instruct, GRPO on reasoning-gym basic_arithmetic) on one GPU: vLLM engine
# (CUDA graphs, 0.4 GPU in Ray, 30% of the card's memory) and FSDP2 learner (nccl, 0.5 GPU) colocated; the engine
# keeps its memory while the learner trains (no sleep mode). Validation: 256 held-out prompts every 5 steps.
#   bash bench/gpu/train_gpu.sh OUTDIR [STEPS=40] [more overrides]
#   JOB=jobs/retool_tiny.yaml bash bench/gpu/train_gpu.sh OUTDIR 8 ...   # another job file with the same GPU layout
# Stops cleanly (SIGINT -> actors shut down) after TRAIN_TIMEOUT seconds (default 470); metrics.jsonl is per step.
# Runs the rayrl that `python -m` finds first: the current directory's. To run a commit rather than a working tree
# others are editing: git archive COMMIT rayrl | tar -x -C .gpu-head; cd .gpu-head; bash ../bench/gpu/train_gpu.sh
set -uo pipefail
out=${1:?OUTDIR}; steps=${2:-40}; shift 2 || shift $#
mkdir -p "$out"; log=$out/train.log
gpu() { echo "== nvidia-smi $1 $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv;
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; }
rm -rf /tmp/rayrl-train  # metrics.jsonl appends: start each run clean
gpu before >> "$log"
set -x
timeout -s INT -k 30 "${TRAIN_TIMEOUT:-470}" python -m rayrl.train ${JOB:-} \
  model.dtype=bfloat16 \
  engine.gpus_per_engine=0.4 engine.gpu_memory_utilization=0.3 engine.enforce_eager=false engine.max_num_seqs=256 \
  learner.gpus_per_worker=0.5 learner.lr=2.0e-5 learner.micro_batch_size=32 \
  rollout.n=8 rollout.max_response_length=256 rollout.concurrency=256 reward.num_procs=8 \
  data.val_source=reasoning_gym:basic_arithmetic data.val_size=256 \
  trainer.batch_size=32 trainer.total_steps="$steps" trainer.test_freq=5 trainer.val_before_train=true \
  trainer.seed=1 trainer.resume=disable trainer.experiment_name=gpu_smollm2 trainer.output_dir=/tmp/rayrl-train "$@" \
  >> "$log" 2>&1
rc=$?
set +x
echo "== rayrl.train exit code $rc" >> "$log"
sleep 3
gpu after >> "$log"
used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)
echo "== GPU after the run: ${used} MiB used, ${apps} compute processes ($([ "$apps" = 0 ] && echo clean || echo NOT CLEAN))" >> "$log"
echo "== leftover ray/vllm processes:" >> "$log"; ps -eo pid,cmd | grep -E "ray::|raylet|gcs_server|EngineCore|VLLM" | grep -v grep >> "$log"
cp /tmp/rayrl-train/metrics.jsonl "$out/" 2>/dev/null
tail -n 60 "$log"
exit $rc
