#!/usr/bin/env bash
# Prove the kit's device command here: a fresh venv that has torch alone, the kit's wheels installed exactly as
# the device command installs them (--no-index --no-deps --target /tmp/site, PYTHONPATH, `python3 -m maskbench`),
# then benchmarks/gpu_check.sh --cpu.
#
#     bash benchmarks/device/prove_kit.sh [OUT_DIR]     # default OUT_DIR: /tmp/kit_out; the venv: $KIT_VENV
#     KIT_PYTHON=~/.pyenv/versions/3.12.1/bin/python3.12 bash benchmarks/device/prove_kit.sh   # Python 3.12, as there
#
# The venv (KIT_PYTHON -m venv, default python3): torch alone first (KIT_TORCH, default the device's own pair from
# PyPI, torch 2.11.0 and torchvision 0.26.0, whose CUDA builds run on a CPU too), then what the GPU machine's image
# already holds and maskbench imports (benchmarks/device/image-requirements.txt, with their own dependencies),
# standing in for that image: the device command carries none of them. Not in it: maskbench itself (the checkout on
# PYTHONPATH, as on the device). torchvision must be the build of that torch: with this machine's own
# torch 2.13.0+cpu (KIT_TORCH="torch==2.13.0 torchvision==0.28.0") PyPI's torchvision 0.28.0, a CUDA build, does
# not load ("operator torchvision::nms does not exist"), and timm, open_clip and clean-fid import torchvision.
#
# The venv is built once per (Python, torch, image-requirements.txt) and reused after (its spec in $venv/kit-spec):
# building it downloads ~3 GB. `--setup` builds it and stops, so the download can run apart from the check.
set -euo pipefail
cd "$(dirname "$0")/../.."
setup_only=0
if [ "${1:-}" = "--setup" ]; then setup_only=1; shift; fi
venv=${KIT_VENV:-/tmp/kitvenv}
out=${1:-/tmp/kit_out}
[ -d .whl ] || bash benchmarks/device/kit.sh > /dev/null
rm -rf "$out" /tmp/site
torch=${KIT_TORCH:-torch==2.11.0 torchvision==0.26.0}
spec="${KIT_PYTHON:-python3} $torch $(sha256sum benchmarks/device/image-requirements.txt | cut -c1-16)"
if [ "$(cat "$venv/kit-spec" 2>/dev/null)" != "$spec" ]; then
  rm -rf "$venv"
  "${KIT_PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q ${torch%% *}
  "$venv/bin/python" -m pip install -q $torch -r benchmarks/device/image-requirements.txt
  "$venv/bin/python" -m pip list --format=freeze > "$venv/pip-list.txt"
  echo "$spec" > "$venv/kit-spec"
fi
echo "prove_kit: venv $venv: $("$venv/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
[ "$setup_only" = 1 ] && exit 0
if (cd / && "$venv/bin/python" -c "import maskbench; import diffusers" 2>/dev/null); then  # outside the checkout
  echo "prove_kit: maskbench and the kit's packages import before the kit's install: not a fresh venv" >&2
  exit 1
fi
mkdir -p "$out"
# The device command as the kit prints it, but --cpu: this machine has no GPU.
command=$(bash benchmarks/device/kit.sh --print | sed -n 2p | sed 's|benchmarks/gpu_check.sh --out|benchmarks/gpu_check.sh --cpu --out|')
echo "prove_kit: running: $command"
PATH="$venv/bin:$PATH" OUT="$out" bash -c "$command"
