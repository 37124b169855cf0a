#!/usr/bin/env bash
# Where the time goes while a run trains: py-spy on the engine actor, its EngineCore process, the Gateway, one rollout
# worker and one learner worker, all sampled over the same seconds, once the run's metrics.jsonl has STEP steps.
#   bash bench/gpu/pyspy_during.sh OUTDIR RUN_DIR/metrics.jsonl [STEP=4] [SECONDS=10] &    # beside async_gpu.sh
# Writes OUTDIR/<Process>.txt (collapsed stacks of the threads on a CPU, --nonblocking: the processes are not paused)
# with its .log, and ps.txt (top over 2 s). Summarise with `python bench/gpu/pyspy_top.py OUTDIR/[A-Z]*.txt`.
# py-spy comes from .gpu-bundles/extra (bench/gpu/README.md, ninth-session notes).
set -uo pipefail
out=${1:?OUTDIR}; metrics=${2:?metrics.jsonl}; step=${3:-4}; secs=${4:-10}
mkdir -p "$out"
for _ in $(seq 900); do
  [ -f "$metrics" ] && [ "$(wc -l < "$metrics")" -ge "$step" ] && break; sleep 1
done
top -b -n 2 -d 2 -w 250 -c | awk '/^top -/{n++} n==2' | head -45 > "$out/ps.txt" 2>&1
for name in VLLM::EngineCore VLLM::Worker ray::Engine ray::Gateway ray::Rollout ray::Learner; do
  pid=$(pgrep -f "^$name( |\.|$)" | head -1)  # ray names an actor process ray::<Class>[.method]
  [ -n "$pid" ] || { echo "no $name" >> "$out/ps.txt"; continue; }
  py-spy record --nonblocking --threads -r 100 -d "$secs" -f raw -o "$out/${name#*::}.txt" --pid "$pid" \
    > "$out/${name#*::}.log" 2>&1 &
done
wait
