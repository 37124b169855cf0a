#!/usr/bin/env bash
# The ReTool chain on one GPU (issue #15): the cold-start SFT of jobs/retool_sft_tiny.yaml, then RL with the tool
# agent from its Hugging Face folder (jobs/retool_tiny.yaml with bench/gpu/train_gpu.sh's one-GPU layout), validation
# accuracy and tool-call rate every 5 steps. The traces come prepared (`python -m rayrl.prepare tool-traces ...`,
# deterministic) in DATA, carried with the call. The SFT's folder lives in /tmp (a call's repo copy is fresh each
# call; /tmp survives ~30 s), so `sft` and `rl` can go in separate calls back to back.
#   bash bench/gpu/retool_gpu.sh sft OUT [overrides]      # -> /tmp/rayrl-sft/hf, OUT/sft.log, OUT/sft_metrics.jsonl
#   bash bench/gpu/retool_gpu.sh rl OUT STEPS [overrides] # -> OUT/train.log, OUT/metrics.jsonl
# The RL questions are harder than the SFT traces' (2-5 terms of up to 4 digits, against 2 terms of 1-2): the model
# must copy longer expressions into its program, so accuracy has room to move.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd); stage=${1:?sft|rl}; out=${2:?OUT}; shift 2
data=${DATA:-outputs/data}; mkdir -p "$out"
case $stage in
sft)
  rm -rf /tmp/rayrl-sft
  timeout -s INT -k 30 "${SFT_TIMEOUT:-300}" python -m rayrl sft jobs/retool_sft_tiny.yaml \
    model.dtype=bfloat16 learner.gpus_per_worker=1 \
    sft.train_file="$data/tool_traces.parquet" sft.val_file="$data/tool_traces_val.parquet" \
    trainer.output_dir=/tmp/rayrl-sft "$@" > "$out/sft.log" 2>&1
  rc=$?; echo "== rayrl sft exit code $rc" >> "$out/sft.log"
  cp /tmp/rayrl-sft/metrics.jsonl "$out/sft_metrics.jsonl" 2>/dev/null; ls /tmp/rayrl-sft/hf >> "$out/sft.log" 2>&1
  tail -n 25 "$out/sft.log"; exit $rc;;
rl)
  steps=${1:?STEPS}; shift
  JOB=jobs/retool_tiny.yaml bash "$here/train_gpu.sh" "$out" "$steps" \
    model.path=/tmp/rayrl-sft/hf rollout.max_response_length=384 sandbox.max_concurrency=8 \
    'data.gym_kwargs={min_terms: 2, max_terms: 5, min_digits: 1, max_digits: 4}' \
    trainer.experiment_name=gpu_retool "$@";;
*) echo "retool_gpu.sh: stage must be sft or rl, got $stage" >&2; exit 2;;
esac
