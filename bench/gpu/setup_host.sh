#!/usr/bin/env bash
# On the GPU host: collect one part (from prepare_host.sh) into /tmp/parts; when all NPARTS are there, join,
# check sha256, install everything with --no-deps into /tmp/site, build pycosat (or a stub if no compiler).
#   bash bench/gpu/setup_host.sh .gpu-bundles/pNN
# Afterwards: source bench/gpu/env.sh
set -euo pipefail
part=$1; parts=/tmp/parts; site=/tmp/site
mkdir -p $parts && cp "$part"/all.tar.part-* $parts/
n=$(cat "$part/NPARTS"); have=$(ls $parts/all.tar.part-* | wc -l)
echo "setup_host: $have of $n parts in $parts"
[ "$have" -lt "$n" ] && exit 0
[ -e $site/.complete ] && { echo "setup_host: already installed"; exit 0; }
t0=$(date +%s)
mkdir -p /tmp/stage && cat $parts/all.tar.part-* | tar -C /tmp/stage -xf -
(cd /tmp/stage && sha256sum --quiet -c MANIFEST)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site /tmp/stage/wheels/*.whl
for s in /tmp/stage/sdists/*; do
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target $site "$s" || {
    m=$(basename "$s" | cut -d- -f1); echo "setup_host: $m did not build; writing a stub (reasoning-gym imports it, arithmetic never calls it)"
    printf 'def solve(*a, **k):\n    raise RuntimeError("pycosat stub: not built on this host")\ndef itersolve(*a, **k):\n    raise RuntimeError("pycosat stub")\n' > $site/$m.py; }
done
touch $site/.complete
echo "setup_host: installed $(ls /tmp/stage/wheels | wc -l) wheels + $(ls /tmp/stage/sdists | wc -l) sdists into $site in $(( $(date +%s) - t0 )) s"
rm -rf /tmp/stage $parts
