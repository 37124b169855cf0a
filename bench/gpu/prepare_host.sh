#!/usr/bin/env bash
# Here (a machine with network): download every wheel versions.toml pins for a CUDA machine ([cuda] + [common], less
# torch, which the GPU host image has) and pack them as parts of at most PART_MIB (default 54) MiB, so each device
# call carries one part (a call's working tree is limited to 64 MiB).
#   bash bench/gpu/prepare_host.sh [OUTDIR=.gpu-bundles]
# Then, back to back (the host keeps /tmp only while warm), one call per part:
#   run(carry=[".gpu-bundles/pNN"], command="bash bench/gpu/setup_host.sh .gpu-bundles/pNN")
# and the last part's call installs everything with `RAYRL_WHEELS=... scripts/install.sh` (setup_host.sh does that
# when it sees the last part): the same install a CUDA machine with network gets from versions.toml.
set -euo pipefail
out=${1:-.gpu-bundles}; mib=${PART_MIB:-30}  # parts + the tracked tree (26 MiB, 2026-12-06) must fit the 64 MiB a device call carries
here=$(cd "$(dirname "$0")" && pwd); versions=$here/../../scripts/versions.py
stage=$out/.stage; rm -rf "$out"; mkdir -p "$stage/wheels" "$stage/sdists"
python3 "$versions" cuda wheels > "$out/.specs"    # versions.toml [cuda] + [common]; the host image has torch
python3 "$versions" cuda sdists > "$out/.sdists"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 -d "$stage/wheels" -r "$out/.specs"
# sdist-only packages: pure-Python ones become wheels here; pycosat (C) travels as its sdist
python3 -m pip download -q --no-deps --no-binary=:all: -d "$stage/sdists" -r "$out/.sdists"
for s in "$stage"/sdists/*; do
  case "$s" in *pycosat*) ;; *) python3 -m pip wheel -q --no-deps --no-build-isolation -w "$stage/wheels" "$s" && rm "$s";; esac
done
(cd "$stage" && sha256sum wheels/* sdists/*) > "$stage/MANIFEST"
tar -C "$stage" -cf "$out/all.tar" .
rm -rf "$stage" "$out/.specs" "$out/.sdists"
split -b $((mib * 1024 * 1024)) -d -a 2 "$out/all.tar" "$out/all.tar.part-"
rm "$out/all.tar"
i=0; for p in "$out"/all.tar.part-*; do d=$(printf '%s/p%02d' "$out" $i); mkdir -p "$d"; mv "$p" "$d/"; i=$((i + 1)); done
echo "$i" > "$out/NPARTS"; for d in "$out"/p*; do cp "$out/NPARTS" "$d/"; done
echo "parts in $out: $i, total $(du -sh "$out" | cut -f1)"
