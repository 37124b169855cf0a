#!/usr/bin/env bash
# On the GPU host: collect one part (from prepare_host.sh) into /tmp/parts; when all NPARTS are there, join, check
# sha256, and install the way users do: scripts/install.sh (it finds the GPU: versions.toml's CUDA pins), offline
# from the joined wheels (RAYRL_WHEELS). The host's python3 is the system's (PEP 668): this throwaway machine
# installs into it (PIP_BREAK_SYSTEM_PACKAGES); its torch 2.11.0+cu130 is the one versions.toml pins.
#   bash bench/gpu/setup_host.sh .gpu-bundles/pNN
# Afterwards: source bench/gpu/env.sh
set -euo pipefail
part=$1; parts=/tmp/parts; stage=/tmp/stage; done_mark=/tmp/rayrl-installed
mkdir -p $parts && cp "$part"/all.tar.part-* $parts/
n=$(cat "$part/NPARTS"); have=$(ls $parts/all.tar.part-* | wc -l)
echo "setup_host: $have of $n parts in $parts"
[ "$have" -lt "$n" ] && exit 0
[ -e $done_mark ] && { echo "setup_host: already installed"; exit 0; }
t0=$(date +%s)
mkdir -p $stage && cat $parts/all.tar.part-* | tar -C $stage -xf -
(cd $stage && sha256sum --quiet -c MANIFEST)
PYTHON=python3 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 RAYRL_WHEELS=$stage bash scripts/install.sh
touch $done_mark
echo "setup_host: installed $(ls $stage/wheels | wc -l) wheels + $(ls $stage/sdists | wc -l) sdists in $(( $(date +%s) - t0 )) s"
rm -rf $parts  # the unpacked wheels stay in /tmp/stage: `RAYRL_WHEELS=/tmp/stage make train` installs from them offline
