#!/usr/bin/env bash
# Issue #14 on the GPU host (after setup_host.sh): bench_seed.py cases, each in its own process with a timeout.
#   bash bench/gpu/seed_bench.sh OUT CASE...        a CASE prefixed "old=" runs with OLD_RAYRL (a rayrl tree of an
#   older commit: `git archive COMMIT rayrl | tar -x -C .gpu-old`) first on PYTHONPATH, labelled OLD_LABEL.
set -uo pipefail
out=$1; shift; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
source "$here/env.sh"
# the caching allocator's fragmentation alone ran the 4B shape out of an 80 GB card (results/2026-12-05c/seed_oom);
# the H200 runs of 2026-12-03 ran without it
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
for x in .gpu-bundles/extra/*.whl; do [ -e "$x" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$x"; done
for case in "$@"; do
  if [[ $case == old=* ]]; then
    case=${case#old=}; pp="${OLD_RAYRL:?}:$PYTHONPATH"; label=${OLD_LABEL:-old}
  else
    pp=$PYTHONPATH; label=${LABEL:-HEAD}
  fi
  echo "== $case ($label)"
  PYTHONPATH=$pp timeout "${CASE_TIMEOUT:-240}" python3 "$here/bench_seed.py" "$case" --out "$out" --label "$label" \
    > "$out/${case//:/_}-$label.log" 2>&1
  echo "rc=$?"; grep -E "^SEED|^made" "$out/${case//:/_}-$label.log" | cut -c1-900
done
nvidia-smi --query-gpu=memory.used --format=csv
