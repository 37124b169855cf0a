#!/usr/bin/env bash
# Issue #7's measurements on one host with N GPUs (not yet run: no multi-GPU machine was lent). After setup_host.sh:
#   source bench/gpu/env.sh && bash bench/gpu/multi_gpu.sh N OUTDIR
# For the tiny ReTool job and a random-init Qwen2.5-0.5B-shaped model, three layouts, each a short run whose
# metrics.jsonl lands in OUTDIR/<model>_<layout>/:
#   1gpu      engine 0.4 + learner 0.5 on one GPU (cuda_ipc sync) -- the baseline for scaling
#   coloc     N engines and N learner ranks, engine i on learner rank i's GPU (cuda_ipc sync)
#   split     N/2 engine GPUs + N/2 learner GPUs (FSDP over N/2 ranks, NCCL broadcast sync in buckets)
# Report from each metrics.jsonl: rollout/tokens_per_s and learner/tokens_per_s (divide by GPUs), sync/seconds,
# time/share_*; scaling = N-GPU tokens/s over 1gpu tokens/s. NVLink multicast stays off (env.sh + every actor).
set -uo pipefail
n=${1:?N GPUs}; out=${2:?OUTDIR}; steps=${STEPS:-6}; mkdir -p "$out"
python3 -c "import sys; sys.path.insert(0, 'bench/gpu'); from bench_engine import make_qwen05; from rayrl.models import resolve_model; print(make_qwen05('/tmp/rayrl-cache/qwen05-shape', resolve_model('smollm2')))"
half=$(( n / 2 ))
for model in retool qwen05; do
  if [ $model = retool ]; then job=jobs/retool_tiny.yaml; extra=(sandbox.max_concurrency=16)
  else job=jobs/quickstart.yaml; extra=(model.path=/tmp/rayrl-cache/qwen05-shape rollout.max_response_length=512); fi
  for layout in 1gpu coloc split; do
    case $layout in
      1gpu)  lay=(engine.num_engines=1 engine.gpus_per_engine=0.4 learner.num_workers=1 learner.gpus_per_worker=0.5) ;;
      coloc) lay=(engine.num_engines=$n engine.gpus_per_engine=0.4 learner.num_workers=$n learner.gpus_per_worker=0.5) ;;
      split) lay=(engine.num_engines=$half engine.gpus_per_engine=1 learner.num_workers=$half learner.gpus_per_worker=1) ;;
    esac
    dir=$out/${model}_$layout; mkdir -p "$dir"
    echo "== $model $layout: ${lay[*]}"
    timeout -s INT -k 30 "${RUN_TIMEOUT:-420}" python -m rayrl.train $job model.dtype=bfloat16 engine.enforce_eager=true \
      engine.gpu_memory_utilization=0.3 rollout.n=8 trainer.batch_size=32 trainer.total_steps=$steps \
      trainer.resume=disable trainer.test_freq=0 data.val_source=null trainer.experiment_name=${model}_$layout \
      trainer.output_dir=/tmp/rayrl-multi/${model}_$layout "${lay[@]}" "${extra[@]}" > "$dir/train.log" 2>&1
    echo "   exit $?"; cp /tmp/rayrl-multi/${model}_$layout/metrics.jsonl "$dir/" 2>/dev/null
    grep -E "^step [0-9]+:" "$dir/train.log" | tail -2
  done
done
nvidia-smi --query-gpu=index,memory.used --format=csv
