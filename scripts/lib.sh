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

# One job on a fresh aloe-server: starts $ALOE_BIN_DIR/aloe-server with CONFIG (logs and port
# file in DIR), runs one aloe-worker on CORPUS with the remaining flags until the server's stop
# condition, and waits for both. Returns non-zero (log tails on stderr) when either fails.
# ALOE_JOB_WORKER names another worker program taking --server and --corpus_dir (the Python
# worker's example); aloe-worker also gets --metrics=off.
# Usage: aloe_one_worker_job DIR CONFIG CORPUS [worker flags...]
aloe_one_worker_job() {
  local dir="$1" config="$2" corpus="$3"
  shift 3
  mkdir -p "$dir"
  rm -f "$dir/ports"
  "$ALOE_BIN_DIR/aloe-server" --config="$config" --port_file="$dir/ports" >"$dir/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 300); do [ -s "$dir/ports" ] && break; sleep 0.1; done
  local port
  port=$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' "$dir/ports" 2>/dev/null)
  if [ -z "$port" ]; then
    kill "$server" 2>/dev/null || true
    tail -n 20 "$dir/server.log" >&2
    return 1
  fi
  local rc=0
  local worker=("$ALOE_BIN_DIR/aloe-worker" --metrics=off)
  if [ -n "${ALOE_JOB_WORKER:-}" ]; then worker=("$ALOE_JOB_WORKER"); fi
  "${worker[@]}" --server="127.0.0.1:$port" --corpus_dir="$corpus" "$@" >"$dir/worker.log" 2>&1 ||
    rc=$?
  # A failed worker leaves the server waiting for work: stop it (SIGTERM drains and exits).
  if [ "$rc" -ne 0 ]; then kill "$server" 2>/dev/null || true; fi
  wait "$server" || [ "$rc" -ne 0 ] || rc=1
  if [ "$rc" -ne 0 ]; then tail -n 20 "$dir/server.log" "$dir/worker.log" >&2; fi
  return "$rc"
}

# The server's receive_window_kib for workers on LINKS (RATE_MBIT:RTT_MS,...): twice the
# largest bandwidth-delay product, in KiB, within the range the config accepts
# (docs/operations.md, long links).
aloe_link_window_kib() {
  echo "$1" | tr ',' '\n' | awk -F: '
    { kib = 2 * $1 * 1e6 / 8 * $2 / 1e3 / 1024; if (kib > max) max = kib }
    END { max = int(max + 1); if (max < 2048) max = 2048; if (max > 262144) max = 262144; print max }'
}

aloe_log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
