#!/usr/bin/env bash
# The ALOE demo cluster on loopback: aloe-server, an evaluator and two heterogeneous trainers
# (the second slowed down to emulate weaker hardware) train a byte-level transformer on the
# State of the Union corpus under async DiLoCo (Delayed Nesterov, DyLU, a grace window), print
# progress and the status page's address, then run the same job under sync DiLoCo and end with
# the comparison: time to the same held-out perplexity and each trainer's share of time blocked.
# Stops every process it started (also on Ctrl-C).
#
# Usage: scripts/demo.sh [--mode async|sync] [--no-compare] [--seconds N] [--slowdown F]
#                        [--shards N] [--config FILE] [--tokenizer byte|gpt2]
#   --mode M       async: grace-period batching, Delayed Nesterov, DyLU (default);
#                  sync: DiLoCo round barrier, outer Nesterov
#   --no-compare   run only the job of --mode (the default runs the other mode after it)
#   --seconds N    training time of each job (default 100)
#   --slowdown F   the second trainer runs F times slower (default 2)
#   --shards N     a layer-sharded server: a coordinator and N shard processes holding the
#                  parameters, instead of one process (default 0). Either way the server
#                  takes raw pushes (--push_listen) besides gRPC
#   --config FILE  server config of --mode's job (default deploy/configs/demo-async.textproto
#                  or demo.textproto); the comparison job uses the other default
#   --tokenizer T  byte: one token per byte (default); gpt2: GPT-2's BPE (vocabulary 50257,
#                  data/sotu-gpt2) on deploy/configs/demo-gpt2.textproto, one sync job, no
#                  comparison (a CPU spends most of each step in the 50257-way output layer)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

SECONDS_TO_TRAIN=100
SLOWDOWN=2
CONFIG=""
MODE=async
COMPARE=1
SHARDS=0
TOKENIZER=byte
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) MODE="$2"; shift 2 ;;
    --no-compare) COMPARE=0; shift ;;
    --seconds) SECONDS_TO_TRAIN="$2"; shift 2 ;;
    --slowdown) SLOWDOWN="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --tokenizer) TOKENIZER="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

config_of() {
  case "$1" in
    sync) echo "$ALOE_ROOT/deploy/configs/demo.textproto" ;;
    async) echo "$ALOE_ROOT/deploy/configs/demo-async.textproto" ;;
  esac
}
case "$MODE" in
  sync) OTHER=async ;;
  async) OTHER=sync ;;
  *) echo "demo.sh: --mode must be async or sync" >&2; exit 2 ;;
esac
CORPUS=data/sotu
case "$TOKENIZER" in
  byte) ;;
  gpt2)
    CORPUS=data/sotu-gpt2 MODE=sync COMPARE=0
    CONFIG="${CONFIG:-$ALOE_ROOT/deploy/configs/demo-gpt2.textproto}"
    ;;
  *) echo "demo.sh: --tokenizer must be byte or gpt2, got '$TOKENIZER'" >&2; exit 2 ;;
esac
CONFIG="${CONFIG:-$(config_of "$MODE")}"
if ! [[ "$SHARDS" =~ ^[0-9]+$ ]] || [ "$SHARDS" -gt 16 ]; then
  echo "demo.sh: --shards must be a number of shard processes in [0, 16], got '$SHARDS'" >&2
  exit 2
fi
if ! [[ "$SECONDS_TO_TRAIN" =~ ^[0-9]+$ ]] || [ "$SECONDS_TO_TRAIN" -lt 10 ]; then
  echo "demo.sh: --seconds must be a whole number of seconds >= 10, got '$SECONDS_TO_TRAIN'" >&2
  exit 2
fi

cd "$ALOE_ROOT"
"$ALOE_ROOT/scripts/install-deps.sh"
aloe_log "building aloe-server, aloe-worker, aloe-corpus"
aloe_build aloe-server aloe-worker aloe-corpus
"$ALOE_ROOT/scripts/prepare-corpus.sh" --tokenizer "$TOKENIZER" "$CORPUS"
aloe_blas_env

OUT_DIR="$ALOE_ROOT/out/demo"
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 0.5
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  PIDS=()
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
metric() {
  curl -s "http://127.0.0.1:$2/metrics" 2>/dev/null | awk -v m="$1" '$1 == m {print $2}'
}
tokps() { grep -o 'tokens/s [0-9]*' "$1" 2>/dev/null | tail -1 | awk '{print $2}'; }

# Runs one job of MODE with CONFIG for SECONDS_TO_TRAIN in RUN_DIR: the server (and shard
# processes), an evaluator, worker-fast and worker-slow; progress every 10 s; the summary.
run_job() {
  local mode="$1" config="$2" run_dir="$3"
  mkdir -p "$run_dir"
  local server_flags=(--push_listen="127.0.0.1:$(free_port)")
  [ "$SHARDS" -gt 0 ] && server_flags=(--role=coordinator --shard_processes="$SHARDS")
  "$ALOE_BIN_DIR/aloe-server" --config="$config" --max_seconds="$SECONDS_TO_TRAIN" \
    --port_file="$run_dir/ports" --summary_file="$run_dir/summary" "${server_flags[@]}" \
    >"$run_dir/server.log" 2>&1 &
  local server_pid=$!
  PIDS+=("$server_pid")
  wait_ports "$run_dir/ports" "the server" "$run_dir/server.log"
  local grpc_port metrics_port
  grpc_port=$(port_of grpc "$run_dir/ports")
  metrics_port=$(port_of metrics "$run_dir/ports")
  aloe_log "$mode job: server on 127.0.0.1:$grpc_port, metrics on http://127.0.0.1:$metrics_port/metrics"
  aloe_log "status page: http://127.0.0.1:$metrics_port/  (open it in a browser while it runs)"
  local shard_metrics=() i
  for ((i = 0; i < SHARDS; i++)); do
    "$ALOE_BIN_DIR/aloe-server" --config="$config" --role=shard --shard_processes="$SHARDS" \
      --shard_index="$i" --coordinator="127.0.0.1:$grpc_port" --listen="127.0.0.1:$(free_port)" \
      --push_listen="127.0.0.1:$(free_port)" --metrics=127.0.0.1:0 \
      --port_file="$run_dir/shard$i.ports" >"$run_dir/shard$i.log" 2>&1 &
    PIDS+=("$!")
    wait_ports "$run_dir/shard$i.ports" "shard process $i" "$run_dir/shard$i.log"
    shard_metrics+=("$(port_of metrics "$run_dir/shard$i.ports")")
  done
  if [ "$SHARDS" -gt 0 ]; then
    aloe_log "the server is layer-sharded: $SHARDS shard processes hold the parameters, status pages on ports ${shard_metrics[*]}"
  fi

  local worker=("$ALOE_BIN_DIR/aloe-worker" --server="127.0.0.1:$grpc_port" --corpus_dir="$CORPUS")
  declare -A role_pid
  "${worker[@]}" --role=evaluator --name=evaluator --eval_sequences=48 >"$run_dir/evaluator.log" 2>&1 &
  role_pid[evaluator]=$!
  "${worker[@]}" --name=worker-fast >"$run_dir/worker-fast.log" 2>&1 &
  role_pid[worker-fast]=$!
  "${worker[@]}" --name=worker-slow --slowdown="$SLOWDOWN" >"$run_dir/worker-slow.log" 2>&1 &
  role_pid[worker-slow]=$!
  PIDS+=("${role_pid[@]}")
  aloe_log "started an evaluator and 2 workers (worker-slow at ${SLOWDOWN}x); $mode training for ${SECONDS_TO_TRAIN}s"

  local role p
  while kill -0 "$server_pid" 2>/dev/null; do
    sleep 10
    kill -0 "$server_pid" 2>/dev/null || break
    for role in "${!role_pid[@]}"; do
      if ! kill -0 "${role_pid[$role]}" 2>/dev/null && ! wait "${role_pid[$role]}"; then
        echo "demo.sh: $role exited with an error; its log ends with:" >&2
        tail -n 5 "$run_dir/$role.log" >&2
        exit 1
      fi
    done
    local shards=""
    if [ "$SHARDS" -gt 0 ]; then
      local versions=()
      for p in "${shard_metrics[@]}"; do versions+=("$(metric aloe_model_version "$p")"); done
      shards=" shards at $(IFS=/; echo "${versions[*]}")"
    fi
    printf '[%s] %-5s version %-4s eval perplexity %-8s tokens/s fast %-6s slow %-6s%s\n' \
      "$(date +%H:%M:%S)" "$mode" "$(metric aloe_model_version "$metrics_port")" \
      "$(metric aloe_eval_perplexity "$metrics_port" | awk '{ if ($1 > 0) printf "%.2f", $1; else printf "-" }')" \
      "$(tokps "$run_dir/worker-fast.log")" "$(tokps "$run_dir/worker-slow.log")" "$shards"
  done
  wait "$server_pid" || { echo "demo.sh: the server failed; see $run_dir/server.log" >&2; exit 1; }
  # The workers end with the job; give them a moment to log their summaries.
  for role in "${!role_pid[@]}"; do
    for _ in $(seq 1 100); do kill -0 "${role_pid[$role]}" 2>/dev/null || break; sleep 0.1; done
  done
  cleanup

  echo
  echo "==== $mode job summary ===="
  grep 'summary:' "$run_dir/server.log" | sed 's/^.*summary: /server: /'
  grep 'raw pushes:' "$run_dir/server.log" | sed 's/^.*raw pushes: /server: raw pushes: /' || true
  for ((i = 0; i < SHARDS; i++)); do
    grep 'summary:' "$run_dir/shard$i.log" | sed 's/^.*summary: //' || true
  done
  for role in worker-fast worker-slow; do
    grep 'summary:' "$run_dir/$role.log" | sed "s/^.*summary: /$role: /" || true
  done
  local first last
  first=$(grep '^eval=' "$run_dir/summary" | head -1 | cut -d: -f2)
  last=$(grep '^eval=' "$run_dir/summary" | tail -1 | cut -d: -f2)
  if [ -z "$first" ] || [ -z "$last" ]; then
    echo "demo.sh: no evaluations recorded in the $mode job" >&2; exit 1
  fi
  awk -v a="$first" -v b="$last" 'BEGIN {
    pa = exp(a); pb = exp(b); drop = 100 * (pa - pb) / pa;
    printf "held-out perplexity %.2f -> %.2f (%.1f%% lower)\n", pa, pb, drop; exit (drop >= 20 ? 0 : 1) }' \
    || { echo "demo.sh: perplexity fell by less than 20% in the $mode job" >&2; exit 1; }
  echo
}

run_job "$MODE" "$CONFIG" "$OUT_DIR/$MODE"
if [ "$COMPARE" -eq 1 ]; then
  aloe_log "the same job under $OTHER for comparison"
  run_job "$OTHER" "$(config_of "$OTHER")" "$OUT_DIR/$OTHER"
  echo "==== comparison ===="
  python3 "$ALOE_ROOT/scripts/demo_compare.py" "$OUT_DIR/async" "$OUT_DIR/sync"
fi
echo "logs: $OUT_DIR"
