#!/usr/bin/env bash
# Run a command with NVIDIA's Multi-Process Service (MPS) on this host's GPU, then stop it:
#   bash bench/gpu/mps.sh COMMAND [ARGS...]
# Without MPS the CUDA contexts of the processes sharing one GPU (the vLLM engines, the learner) take turns on it
# (time slices); under MPS their kernels run side by side. A user-level daemon with its own pipe and log folders
# under /tmp: no setting of the card changes (not its compute mode), and the daemon quits when the command ends.
# Every process of the command (Ray starts its workers from this environment) connects to it.
set -uo pipefail
command -v nvidia-cuda-mps-control > /dev/null || { echo "mps.sh: nvidia-cuda-mps-control not found" >&2; exit 2; }
dir=$(mktemp -d /tmp/mps.XXXX)
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "mps.sh: the MPS daemon did not start" >&2; exit 2; }
trap 'echo quit | nvidia-cuda-mps-control; sleep 1; tail -n 5 "$CUDA_MPS_LOG_DIRECTORY/control.log" >&2' EXIT
echo "mps.sh: MPS daemon up ($CUDA_MPS_PIPE_DIRECTORY)" >&2
"$@"
