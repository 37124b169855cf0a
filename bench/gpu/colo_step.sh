#!/usr/bin/env bash
# Issue #14's colocated step on one GPU: jobs/retool_qwen3_4b_1gpu.yaml on the random-init Qwen3-4B shape (tied),
# vLLM at the seed's gpu_memory_utilization 0.9 with sleep mode + the FSDP2 learner (parameters and AdamW state
# offloaded) on the same GPU, 2,048 + 16,384 tokens, cuda_ipc weight sync. Every 5 s the card's used memory and each
# process's share go to OUT/gpu.txt.
#   bash bench/gpu/colo_step.sh OUT [STEPS=2] [more overrides]      (after setup_host.sh; from a git-archive tree)
set -uo pipefail
out=${1:?OUT}; steps=${2:-2}; shift 2 || shift $#
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"
model=$(cd "$here" && python3 -c "import bench_seed; print(bench_seed.model_dir('qwen3-4b', 'tied'))" | tail -1)
( while sleep 5; do echo "== $(date -u +%H:%M:%S) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)";
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done ) > "$out/gpu.txt" 2>&1 &
sampler=$!
rm -rf /tmp/rayrl-colo
timeout -s INT -k 30 "${TRAIN_TIMEOUT:-480}" python3 -m rayrl.train jobs/retool_qwen3_4b_1gpu.yaml \
  model.path="$model" data.source=reasoning_gym:basic_arithmetic data.val_source=null sandbox.backend=local \
  rollout.n=4 trainer.batch_size=2 learner.mini_batch_size=2 trainer.total_steps="$steps" learner.compile=false \
  trainer.val_before_train=false trainer.save_freq=0 trainer.logger=[console] trainer.resume=disable \
  trainer.output_dir=/tmp/rayrl-colo "$@" > "$out/train.log" 2>&1
rc=$?
kill $sampler
echo "rayrl.train exit code $rc" | tee -a "$out/train.log"
cp /tmp/rayrl-colo/metrics.jsonl "$out/" 2>/dev/null
grep -E "^step|rayrl:|Error|error" "$out/train.log" | cut -c1-600 | tail -20
exit $rc
