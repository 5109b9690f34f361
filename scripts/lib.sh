# Shared helpers for ALOE scripts. Source it: . "$(dirname "$0")/lib.sh"
# shellcheck shell=bash

ALOE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALOE_BUILD_DIR="${ALOE_BUILD_DIR:-$ALOE_ROOT/build}"
ALOE_BIN_DIR="$ALOE_BUILD_DIR/bin"
export ALOE_BIN_DIR

# OpenBLAS 0.3.21 does not recognise recent CPUs and falls back to a slow generic kernel; name a
# core type the CPU supports (measured 5-10x faster on AVX-512 hosts). Respects a user's choice.
aloe_blas_env() {
  if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
    if grep -q ' avx512f ' /proc/cpuinfo 2>/dev/null; then
      export OPENBLAS_CORETYPE=SkylakeX
    elif grep -q ' avx2 ' /proc/cpuinfo 2>/dev/null; then
      export OPENBLAS_CORETYPE=Haswell
    fi
  fi
  # One worker process per core; each uses one intra-op thread.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
}

# Configures (once) and builds the given targets (all when none given).
aloe_build() {
  if [ ! -f "$ALOE_BUILD_DIR/build.ninja" ]; then
    cmake -S "$ALOE_ROOT" -B "$ALOE_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  fi
  cmake --build "$ALOE_BUILD_DIR" -- -j"$(nproc)" "$@"
}

aloe_log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
