#!/usr/bin/env bash
# gpu-bundle.sh: build the release binaries and test executables that a GPU-machine run needs
# and pack them into .gpu/bundle.tar.xz (carry [".gpu"], unpack with `tar xJf`).
#
# The DataFusion binaries are ~120 MB each and largely the same code: one xz stream with a
# dictionary larger than a binary compresses the set about as well as one binary (≈ 50 MB for
# four), where per-file xz -6 would exceed the 64 MiB carry limit.
#
# Build it in the checkout the device receives: tests find the CLI binary and the tree's
# files at the paths recorded at build time (CARGO_BIN_EXE_*, CARGO_MANIFEST_DIR).
#
# KERNELS_ONLY=1: only the kernel and fusion benchmarks and the integration tests (a few
# minutes to pack), for runs of the device work. EXTRA="NAME=PATH …": more executables packed
# under NAME (e.g. an earlier build's benchmark, to compare against in the same call).
# CLI_ONLY=1: only `gpu-topk` (for the user-path benchmark, whose DuckDB wheels need the room).
# TESTS_ONLY=1: `gpu-topk` and the two test binaries.
#
# NVRTC (`.ci/install-nvrtc.sh`) is put on LD_LIBRARY_PATH so that the release build embeds
# the precompiled kernels, as users' builds do.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude) # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")" .gpu
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
if [ -x .ci/install-nvrtc.sh ]; then
    nvrtc_dir=$(.ci/install-nvrtc.sh | tail -n1)
    [ -n "$nvrtc_dir" ] && export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
json=$(mktemp)
stage=$(mktemp -d)
trap 'rm -rf "$stage" "$json"' EXIT
if [ -n "${CLI_ONLY:-}" ]; then
    cargo build --release --bin gpu-topk --message-format=json > "$json"
elif [ -n "${TESTS_ONLY:-}" ]; then
    cargo build --release --bin gpu-topk --message-format=json > "$json"
    cargo test --release --no-run --test all --test sqllogictests --message-format=json >> "$json"
elif [ -n "${KERNELS_ONLY:-}" ]; then
    cargo build --release --bench kernels --bench fused --message-format=json > "$json"
    cargo test --release --no-run --test all --message-format=json >> "$json"
else
    cargo build --release --bin gpu-topk --bench cpu_vs_datafusion --bench kernels --bench fused --message-format=json > "$json"
    cargo test --release --no-run --test all --test sqllogictests --message-format=json >> "$json"
fi
python3 - "$json" "$stage" <<'PY'
import json, os, shutil, sys
src, stage = sys.argv[1], sys.argv[2]
for line in open(src):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"): continue
    name = m["target"]["name"]
    shutil.copy2(m["executable"], os.path.join(stage, name))
    print(f"  {name:24s} {os.path.getsize(m['executable']) / 2**20:8.1f} MiB")
PY
for e in ${EXTRA:-}; do cp "${e#*=}" "$stage/${e%%=*}"; done
for f in "$stage"/*; do strip "$f" 2>/dev/null || true; done
tar -C "$stage" -cf - . | xz -T1 --lzma2=preset=6,dict=768MiB > .gpu/bundle.tar.xz
ls -la .gpu/bundle.tar.xz
