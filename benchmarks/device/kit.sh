#!/usr/bin/env bash
# The device kit: the wheels an air-gapped GPU machine lacks, and the one command to run there.
#
#     bash benchmarks/device/kit.sh            # builds .whl/ (ignored by git), prints its size and the commands
#     bash benchmarks/device/kit.sh --print    # only prints the commands (.whl/ as it is)
#
# The GPU machine (Python 3.12, torch, triton, accelerate and the rest of benchmarks/device/
# image-requirements.txt preinstalled; no network) lacks what benchmarks/device/kit-requirements.txt lists (and
# has a timm of unknown version, which the kit replaces with the one CI tests). This
# fetches each of those, with --no-deps, as a pure-Python wheel where one exists, else as a CPython 3.12 manylinux
# x86-64 wheel; a package published only as an sdist (antlr4-python3-runtime 4.9.3, hydra's parser runtime) is
# built into a wheel here with `pip wheel --no-deps`. One version of each package; at most 40 MiB in all (the
# working tree and the folders carried with it travel to the device in at most 64 MiB).
#
# The printed command installs them there with --no-index --no-deps into /tmp/site, puts /tmp/site and the
# checkout on PYTHONPATH (`python3 -m maskbench`: no console script is installed there) and runs
# benchmarks/gpu_check.sh, which writes its JSON report and one tar of logs and grids under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${KIT_DIR:-.whl}
max_mib=40
pip=(python3 -m pip)

install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $kit/*.whl"
paths='export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1'
first="$install; $paths; bash benchmarks/gpu_check.sh --out \"\$OUT\""
second="$install; $paths; bash benchmarks/device/gpu_bench.sh --out \"\$OUT\""

print_commands() {
  echo "device command 1 (gpu_check, about 8 minutes; carry: [\"$kit\"], timeout_s: 600):"
  echo "  $first"
  echo "device command 2, optional (step time and MFU of dit_b2 and dit_xl2, the loader, repro; carry: [\"$kit\"]):"
  echo "  $second"
  echo "here, the same install in a fresh venv with torch alone (plus the image's packages), --cpu mode:"
  echo "  bash benchmarks/device/prove_kit.sh"
}

if [ "${1:-}" = "--print" ]; then
  print_commands
  exit 0
fi

rm -rf "$kit"
mkdir -p "$kit"
pure=(--only-binary=:all: --python-version 3.12 --implementation py --abi none --platform any)
cp312=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
while read -r req; do
  req=${req%%#*}
  req=${req//[[:space:]]/}
  [ -n "$req" ] || continue
  if "${pip[@]}" download -q --no-deps "${pure[@]}" -d "$kit" "$req" 2>/dev/null; then
    how="pure-Python wheel"
  elif "${pip[@]}" download -q --no-deps "${cp312[@]}" -d "$kit" "$req" 2>/dev/null; then
    how="CPython 3.12 manylinux x86-64 wheel"
  else
    "${pip[@]}" wheel -q --no-deps --no-binary "${req%%=*}" -w "$kit" "$req"
    how="built here from its sdist"
  fi
  echo "kit: $req ($how)"
done < benchmarks/device/kit-requirements.txt

# One version of each package (two stop the whole --no-deps install), nothing but wheels.
names=$(for f in "$kit"/*; do basename "$f" | cut -d- -f1 | tr 'A-Z-.' 'a-z__'; done | sort)
if [ -n "$(uniq -d <<< "$names")" ]; then
  echo "kit: more than one version of: $(uniq -d <<< "$names" | tr '\n' ' ')" >&2
  exit 1
fi
if ls "$kit" | grep -qv '\.whl$'; then
  echo "kit: not a wheel: $(ls "$kit" | grep -v '\.whl$' | tr '\n' ' ')" >&2
  exit 1
fi
bytes=$(cat "$kit"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1048576 }')
echo "kit: $(ls "$kit" | wc -l) wheels in $kit/, $bytes bytes ($mib MiB; at most $max_mib)"
if [ "$bytes" -gt $((max_mib * 1048576)) ]; then
  echo "kit: over $max_mib MiB" >&2
  exit 1
fi
print_commands
