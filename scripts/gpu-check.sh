#!/usr/bin/env bash
# Proves the CUDA backend on a real GPU (written for the H200 device machine; under 5 min).
#
# That machine has no network: carry cffi and pycparser as wheels in .whl/ (see the device
# tool's README), e.g. here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl cffi pycparser
# then run this script there, with `.whl` carried. It installs pdhal + pdhal-cuda into
# /tmp/pdhal-site, runs scripts/gpu_check.py (real kernels writing KV blocks on a stream,
# layer signals through pdhal, a second process verifying every signalled layer's bytes
# through CUDA IPC, latency and host-function overhead), and leaves its log in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/pdhal-site
python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . backends/cuda
cd /tmp  # import the installed copy, not the checkout
PDHAL_PLATFORM=cuda python3 -m pdhal info
PDHAL_PLATFORM=cuda python3 "$OLDPWD/scripts/gpu_check.py" 2>&1 | tee "${OUT:-/tmp}/gpu-check.log"
