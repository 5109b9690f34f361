#!/usr/bin/env bash
# The ALOE demo cluster on loopback: aloe-server, an evaluator and two trainers (the second
# slowed down to emulate weaker hardware) train a byte-level transformer on the State of the
# Union corpus with sync (default) or async DiLoCo, print progress, a final summary, and stop every process they
# started (also on Ctrl-C).
#
# Usage: scripts/demo.sh [--mode sync|async] [--seconds N] [--slowdown F] [--shards N]
#                        [--config FILE]
#   --mode M       sync: DiLoCo round barrier, outer Nesterov (default);
#                  async: grace-period batching, Delayed Nesterov, DyLU
#   --seconds N    training time (default 180)
#   --slowdown F   the second worker runs F times slower (default 2)
#   --shards N     a layer-sharded server: a coordinator and N shard processes holding the
#                  parameters, instead of one process (default 0). Either way the server
#                  takes raw pushes (--push_listen) besides gRPC
#   --config FILE  server config (default deploy/configs/demo.textproto or demo-async.textproto)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

SECONDS_TO_TRAIN=180
SLOWDOWN=2
CONFIG=""
MODE=sync
SHARDS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) MODE="$2"; shift 2 ;;
    --seconds) SECONDS_TO_TRAIN="$2"; shift 2 ;;
    --slowdown) SLOWDOWN="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

case "$MODE" in
  sync) DEFAULT_CONFIG=demo.textproto ;;
  async) DEFAULT_CONFIG=demo-async.textproto ;;
  *) echo "demo.sh: --mode must be sync or async" >&2; exit 2 ;;
esac
CONFIG="${CONFIG:-$ALOE_ROOT/deploy/configs/$DEFAULT_CONFIG}"
if ! [[ "$SHARDS" =~ ^[0-9]+$ ]] || [ "$SHARDS" -gt 16 ]; then
  echo "demo.sh: --shards must be a number of shard processes in [0, 16], got '$SHARDS'" >&2
  exit 2
fi

cd "$ALOE_ROOT"
"$ALOE_ROOT/scripts/install-deps.sh"
aloe_log "building aloe-server, aloe-worker, aloe-corpus"
aloe_build aloe-server aloe-worker aloe-corpus
"$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu
aloe_blas_env

RUN_DIR="$ALOE_ROOT/out/demo"
rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 0.5
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'echo; aloe_log "interrupted: stopping the cluster"; exit 130' INT TERM

# Waits for a daemon's --port_file; exits with its log when it does not start.
wait_ports() {
  for _ in $(seq 1 300); do [ -s "$1" ] && return 0; sleep 0.1; done
  echo "demo.sh: $2 did not start; its log:" >&2; cat "$3" >&2; exit 1
}
port_of() { sed -n "s/.*$1=\([0-9]*\).*/\1/p" "$2"; }
# A loopback port nothing listens on now (shard processes need fixed ports: workers are told them).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

SERVER_FLAGS=(--push_listen="127.0.0.1:$(free_port)")
[ "$SHARDS" -gt 0 ] && SERVER_FLAGS=(--role=coordinator --shard_processes="$SHARDS")
"$ALOE_BIN_DIR/aloe-server" --config="$CONFIG" --max_seconds="$SECONDS_TO_TRAIN" \
  --port_file="$RUN_DIR/ports" --summary_file="$RUN_DIR/summary" "${SERVER_FLAGS[@]}" \
  >"$RUN_DIR/server.log" 2>&1 &
SERVER_PID=$!
PIDS+=("$SERVER_PID")
wait_ports "$RUN_DIR/ports" "the server" "$RUN_DIR/server.log"
GRPC_PORT=$(port_of grpc "$RUN_DIR/ports")
METRICS_PORT=$(port_of metrics "$RUN_DIR/ports")
aloe_log "server on 127.0.0.1:$GRPC_PORT, metrics on http://127.0.0.1:$METRICS_PORT/metrics"
SHARD_METRICS=()
for ((i = 0; i < SHARDS; i++)); do
  "$ALOE_BIN_DIR/aloe-server" --config="$CONFIG" --role=shard --shard_processes="$SHARDS" \
    --shard_index="$i" --coordinator="127.0.0.1:$GRPC_PORT" --listen="127.0.0.1:$(free_port)" \
    --push_listen="127.0.0.1:$(free_port)" --metrics=127.0.0.1:0 \
    --port_file="$RUN_DIR/shard$i.ports" >"$RUN_DIR/shard$i.log" 2>&1 &
  PIDS+=("$!")
  wait_ports "$RUN_DIR/shard$i.ports" "shard process $i" "$RUN_DIR/shard$i.log"
  SHARD_METRICS+=("$(port_of metrics "$RUN_DIR/shard$i.ports")")
done
if [ "$SHARDS" -gt 0 ]; then
  aloe_log "the server is layer-sharded: $SHARDS shard processes hold the parameters, metrics on ports ${SHARD_METRICS[*]}"
fi

WORKER=("$ALOE_BIN_DIR/aloe-worker" --server="127.0.0.1:$GRPC_PORT" --corpus_dir=data/sotu)
declare -A ROLE_PID
"${WORKER[@]}" --role=evaluator --name=evaluator --eval_sequences=48 >"$RUN_DIR/evaluator.log" 2>&1 &
ROLE_PID[evaluator]=$!
"${WORKER[@]}" --name=worker-fast >"$RUN_DIR/worker-fast.log" 2>&1 &
ROLE_PID[worker-fast]=$!
"${WORKER[@]}" --name=worker-slow --slowdown="$SLOWDOWN" >"$RUN_DIR/worker-slow.log" 2>&1 &
ROLE_PID[worker-slow]=$!
PIDS+=("${ROLE_PID[@]}")
aloe_log "started an evaluator and 2 workers (worker-slow at ${SLOWDOWN}x); $MODE training for ${SECONDS_TO_TRAIN}s"

metric() {
  curl -s "http://127.0.0.1:${2:-$METRICS_PORT}/metrics" 2>/dev/null | awk -v m="$1" '$1 == m {print $2}'
}
# The shard processes' model versions, "" with one process.
shard_versions() {
  [ "$SHARDS" -gt 0 ] || return 0
  local versions=() p
  for p in "${SHARD_METRICS[@]}"; do versions+=("$(metric aloe_model_version "$p")"); done
  local IFS=/
  printf ' shards at %s' "${versions[*]}"
}
tokps() { grep -o 'tokens/s [0-9]*' "$1" 2>/dev/null | tail -1 | awk '{print $2}'; }
while kill -0 "$SERVER_PID" 2>/dev/null; do
  sleep 10
  kill -0 "$SERVER_PID" 2>/dev/null || break
  for role in "${!ROLE_PID[@]}"; do
    if ! kill -0 "${ROLE_PID[$role]}" 2>/dev/null && ! wait "${ROLE_PID[$role]}"; then
      echo "demo.sh: $role exited with an error; its log ends with:" >&2
      tail -n 5 "$RUN_DIR/$role.log" >&2
      exit 1
    fi
  done
  printf '[%s] version %-4s eval perplexity %-8s tokens/s fast %-6s slow %-6s%s\n' "$(date +%H:%M:%S)" \
    "$(metric aloe_model_version)" "$(metric aloe_eval_perplexity | xargs printf '%.2f' 2>/dev/null)" \
    "$(tokps "$RUN_DIR/worker-fast.log")" "$(tokps "$RUN_DIR/worker-slow.log")" "$(shard_versions)"
done
wait "$SERVER_PID" || { echo "demo.sh: the server failed; see $RUN_DIR/server.log" >&2; exit 1; }

echo
echo "==== ALOE demo summary ===="
grep 'summary:' "$RUN_DIR/server.log" | sed 's/^.*summary: /server: /'
grep 'raw pushes:' "$RUN_DIR/server.log" | sed 's/^.*raw pushes: /server: raw pushes: /' || true
# The shard processes end with the job (FINISH from the coordinator) and log a summary.
for ((i = 0; i < SHARDS; i++)); do
  for _ in $(seq 1 100); do grep -q 'summary:' "$RUN_DIR/shard$i.log" && break; sleep 0.1; done
  grep 'summary:' "$RUN_DIR/shard$i.log" | sed 's/^.*summary: //' || true
done
for w in worker-fast worker-slow; do
  grep 'summary:' "$RUN_DIR/$w.log" | sed "s/^.*summary: /$w: /" || true
done
FIRST=$(grep '^eval=' "$RUN_DIR/summary" | head -1 | cut -d: -f2)
LAST=$(grep '^eval=' "$RUN_DIR/summary" | tail -1 | cut -d: -f2)
if [ -z "$FIRST" ] || [ -z "$LAST" ]; then
  echo "demo.sh: no evaluations recorded" >&2; exit 1
fi
awk -v a="$FIRST" -v b="$LAST" 'BEGIN {
  pa = exp(a); pb = exp(b); drop = 100 * (pa - pb) / pa;
  printf "held-out perplexity %.2f -> %.2f (%.1f%% lower)\n", pa, pb, drop; exit (drop >= 30 ? 0 : 1) }' \
  || { echo "demo.sh: perplexity fell by less than 30%" >&2; exit 1; }
echo "logs: $RUN_DIR"
