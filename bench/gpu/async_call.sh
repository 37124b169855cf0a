#!/usr/bin/env bash
# One async_gpu.sh run in one device call, py-spy beside it (pyspy_during.sh, at step PROFILE_STEP), everything packed
# into OUT/RUN.tgz (the device returns few files) and the summaries printed:
#   bash bench/gpu/async_call.sh RUN OUT [ROOT [overrides]]  # ROOT (default .): a tree holding an older rayrl (e.g.
#                                                            # .gpu-old), run from it; overrides go to every run
# The SFT (retool_gpu.sh sft) must have run earlier in the same warm period.
set -uo pipefail
run=${1:?RUN}; out=$(realpath -m "${2:?OUT}"); root=${3:-.}; shift $(($# < 3 ? $# : 3))
here=$(cd "$(dirname "$0")" && pwd); a=$out/$run; mkdir -p "$a"
command -v py-spy > /dev/null || for x in .gpu-bundles/extra/py_spy-*.whl; do  # (carry .gpu-bundles/extra)
  [ -e "$x" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$x"; done
(cd "$root" && python3 -c "import rayrl; print('rayrl from', rayrl.__file__)") | tee "$out/$run.log"
bash "$here/pyspy_during.sh" "$a/pyspy" "$a/$run/metrics.jsonl" "${PROFILE_STEP:-5}" 10 &
(cd "$root" && RUNS=$run STEPS=${STEPS:-16} RUN_TIMEOUT=${RUN_TIMEOUT:-300} bash bench/gpu/async_gpu.sh "$a" "$@") \
  >> "$out/$run.log" 2>&1
kill %1 2>/dev/null; wait
tar -xzf "$a/$run/logs.tgz" -O trace.json 2>/dev/null | gzip > "$a/$run/trace.json.gz"
{ tail -n 8 "$out/$run.log"; python3 "$here/driver_gaps.py" "$a/$run/trace.json.gz" | tail -n 25
  python3 "$here/pyspy_top.py" --top 12 "$a"/pyspy/[A-Z]*.txt; } > "$a/summary.txt" 2>&1
tar -czf "$out/$run.tgz" -C "$out" "$run" "$run.log" && rm -rf "$a"
tar -xzf "$out/$run.tgz" -O "$run/summary.txt"
