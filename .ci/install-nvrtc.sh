#!/usr/bin/env bash
# install-nvrtc.sh [DIR]: installs NVRTC 13.0 (libnvrtc.so.13 and its builtins) from the
# `nvidia-cuda-nvrtc` wheel on PyPI into DIR (default: .ci/.nvrtc beside this script), so that
# the kernels can be compiled to sm_90 CUBIN on a machine without a GPU or a CUDA toolkit.
#
# Prints the directory to put on LD_LIBRARY_PATH as its last line of stdout, e.g.
#   export LD_LIBRARY_PATH="$(.ci/install-nvrtc.sh | tail -n1):$LD_LIBRARY_PATH"
# Idempotent (an existing installation is reused). Never fails CI: without pip or PyPI it warns
# and exits 0, and the tests that need NVRTC skip, saying so.
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${1:-${NVRTC_DIR:-$(cd "$here/.." && pwd)/target/nvrtc}}
lib="$dir/nvidia/cu13/lib"

if ls "$lib"/libnvrtc.so.13* >/dev/null 2>&1; then
    echo "nvrtc: already installed in $dir" >&2
    echo "$lib"
    exit 0
fi

python=""
for p in python3 python; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -m pip --version >/dev/null 2>&1; then
        python=$p
        break
    fi
done
if [ -z "$python" ]; then
    echo "warning: nvrtc: no python with pip found; kernel compile checks will be skipped" >&2
    exit 0
fi

mkdir -p "$dir"
if ! "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$dir" "nvidia-cuda-nvrtc==13.0.*" >&2; then
    echo "warning: nvrtc: pip could not install nvidia-cuda-nvrtc==13.0.* (offline?);" \
        "kernel compile checks will be skipped" >&2
    exit 0
fi
if ! ls "$lib"/libnvrtc.so.13* >/dev/null 2>&1; then
    echo "warning: nvrtc: the wheel did not contain $lib/libnvrtc.so.13;" \
        "kernel compile checks will be skipped" >&2
    exit 0
fi
echo "nvrtc: installed in $dir" >&2
echo "$lib"
