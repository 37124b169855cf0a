#!/usr/bin/env bash
# The bench call on the GPU host: install (with the last part), check imports, convert SmolLM2, run the benches.
#   bash bench/gpu/device_bench.sh .gpu-bundles/pNN OUTDIR
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
bash bench/gpu/setup_host.sh "$part" 2>&1 | tee "$out/setup.log" || exit 1
# pytest for tests/gpu, if its wheels came along (pip download --no-deps pytest pluggy iniconfig pygments pytest-timeout)
[ -d .gpu-bundles/pytest ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-bundles/pytest/*.whl
source bench/gpu/env.sh
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -c "import vllm, ray, verl.trainer.ppo.core_algos, verl.workers.config, reasoning_gym, math_verify, pebble, gguf, tensordict, torch, transformers; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import time; t=time.time(); from rayrl.models import resolve_model; print(resolve_model('smollm2'), f'{time.time()-t:.0f}s')"
} 2>&1 | grep -v Warning | tee -a "$out/setup.log"
python3 bench/gpu/bench_engine.py all --out "$out" --parts "${PARTS:-vllm,engine,sync05}" --timeout "${PART_TIMEOUT:-170}" > "$out/bench.log" 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$out/setup.log"
grep -E "^BENCH|^bench part|Error|error" "$out/bench.log" | tail -40
