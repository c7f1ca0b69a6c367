#!/usr/bin/env bash
# dev.sh — the newcomer's entry point (README.md names exactly these two commands).
#
#   ./dev.sh run    install build dependencies, build, run the main job on the host backend
#   ./dev.sh test   install build dependencies, build, run the whole test suite (ctest)
#
# Environment: BUILD_DIR (default build), KVD_CUDA (AUTO|ON|OFF, default AUTO),
#              JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")"
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

# Debian packages the build needs, by name. One list: .ci/run uses this script too.
DEPS=(build-essential cmake ninja-build pkg-config clang libclang-rt-14-dev
      libzmq3-dev libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libjemalloc-dev libsodium-dev libcmocka-dev)

setup() {
    local missing=()
    for p in "${DEPS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        if [ "$(id -u)" != 0 ]; then
            echo "dev.sh: missing packages: ${missing[*]}" >&2
            echo "dev.sh: run as root, or: sudo apt-get install -y ${missing[*]}" >&2
            exit 1
        fi
        echo "dev.sh: installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

build() {
    cmake -S . -B "$BUILD_DIR" -G Ninja -DKVD_CUDA="${KVD_CUDA:-AUTO}" >/dev/null
    cmake --build "$BUILD_DIR" -j "$JOBS"
}

case "${1:-}" in
run)
    setup; build
    # The main job on the embedded default (host backend, no GPU):
    # 1. the page-format report: bits per value, codec error, attention error, CPU throughput;
    echo "== kvcodec: page formats (layers 4, kv_heads 8, head_dim 128, 16-token pages)"
    "$BUILD_DIR/cuda/kvcodec" --layers 4 --kv-heads 8 --head-dim 128 --page-tokens 16 --seed 1
    # 2. the daemon on a temporary endpoint, driven by kvbench's engine processes: RPC round
    #    trips against raw ZeroMQ, pipelining, a 32K-token prefix lookup, reclaim after kill -9.
    echo "== kvbench rpc: kvd (host backend) with engine client processes"
    "$BUILD_DIR/engine-shim/kvbench" rpc --kvd "$BUILD_DIR/kvd/kvd"
    ;;
test)
    setup; build
    cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS"
    ;;
*)
    sed -n '2,10p' "$0"; exit 2 ;;
esac
