#!/usr/bin/env bash
# Issue #18's speed-up on one GPU: bench/async_speedup.py over the ReTool RL job of retool_gpu.sh (the SFT'd tiny
# model in /tmp/rayrl-sft/hf, the tool agent with the local sandbox, 2-5-term questions), with train_gpu.sh's
# one-GPU layout (engine 0.4 GPU / 30% of memory, CUDA graphs; learner 0.5 GPU), the same trained samples per run.
#   bash bench/gpu/retool_gpu.sh sft OUT                       # first, in the same warm period (~60 s)
#   RUNS=s0,s1p STEPS=10 bash bench/gpu/async_gpu.sh OUT [more overrides]
# Every run has retool_gpu.sh's settings (one batch is 32 x 8 = 256 episodes), over WORKERS (default 8) rollout
# workers (processes) with SLOTS (default 16) sandbox slots each; one worker's event loop runs its share of the
# agents (4 workers lagged 18-23 ms on the H200, 8 workers 4-7 ms). An async run fills the slots of a step's
# finished episodes with the next step's while the last ones finish and the learner trains. Each run's actor logs
# and trace.json are packed into OUT/<run>/logs.tgz (the device returns few files).
# INFLIGHT (default 512, two batches) caps the episodes in flight over all workers and the engine's running
# sequences: a synchronous run has one batch (256) to run, an async one can keep the next batch's beside it.
# Every run writes its checkpoints in the background (trainer.async_save): the end-of-run checkpoint (~4 s here)
# is written beside the last weight sync and validation instead of before them.
set -uo pipefail
out=${1:?OUT}; shift
mkdir -p "$out"
python bench/async_speedup.py --runs "${RUNS:-s0,s1p}" --steps "${STEPS:-10}" --out "$out" \
  --val-size "${VAL_SIZE:-128}" --timeout "${RUN_TIMEOUT:-400}" -- \
  model.path=/tmp/rayrl-sft/hf model.dtype=bfloat16 \
  engine.gpus_per_engine=0.4 engine.gpu_memory_utilization=0.3 engine.enforce_eager=false \
  engine.max_num_seqs="${INFLIGHT:-512}" \
  learner.gpus_per_worker=0.5 learner.lr=2.0e-5 learner.micro_batch_size=32 \
  rollout.n=8 rollout.max_response_length=384 rollout.num_workers="${WORKERS:-8}" \
  rollout.concurrency=$((${INFLIGHT:-512} / ${WORKERS:-8})) reward.num_procs=8 sandbox.max_concurrency="${SLOTS:-16}" \
  'data.gym_kwargs={min_terms: 2, max_terms: 5, min_digits: 1, max_digits: 4}' \
  trainer.batch_size=32 trainer.seed=1 trainer.async_save=true trainer.experiment_name=gpu_async "$@" 2>&1 | tail -n 20
rc=${PIPESTATUS[0]}
for d in "$out"/*/; do
  tar -czf "$d/logs.tgz" -C "$d" logs trace.json 2>/dev/null
  rm -rf "$d/logs" "$d/checkpoints" "$d/trace" "$d/trace.json"
  tail -n 4 "$d/console.log" | sed "s|^|$(basename "$d"): |"
done
echo "== GPU after: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader) used; leftover: $(ps -eo cmd | grep -cE 'raylet|EngineCore' ) procs"
exit "$rc"
