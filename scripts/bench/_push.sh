# Shared by scripts/bench/ingest.sh, egress.sh and scale.sh (not a benchmark: bench.sh skips
# files named _*). Starts aloe-server with deploy/configs/bench-push.textproto, layer-sharded: one
# --role coordinator and SHARDS --role shard processes (the config plus `shard_processes: SHARDS`
# and `max_staged_updates: S`), or with SHARDS 0 one single-process aloe-server (the config plus
# `max_staged_updates: S`). Runs aloe-bench-push against it with the given flags, then prints
# every server process's peak RSS (VmHWM, read before it is stopped) and, per shard process (and
# for the single-process server, of the whole model), the memory bound of issue 6: peak RSS <=
# (3 + S) x the bytes of its parameters + a fixed overhead. The processes are stopped
# on every exit path (trap). The benchmark's last line (`ingest: ...` / `scale: ...`) is printed
# last.
#
# Environment: ALOE_BENCH_PIN = RECEIVER,SENDER[,COORDINATOR] (CPU numbers; ingest and egress):
# the server processes and the raw TCP baseline's readers run on RECEIVER only, the benchmark's
# workers and the TCP writers on SENDER only, so that neither side of either measurement shares
# its core with the other side (unset: no pinning); with COORDINATOR the coordinator of a
# layer-sharded server runs there instead (its own core, or one of the sides': a deployment's
# coordinator is on another host than its shards); ALOE_BENCH_MAX_STAGED = S (default 8, the server's
# default); ALOE_BENCH_TRANSPORT = raw (default: the shard processes, or the single-process
# server, also take raw pushes, aloe-server --push_listen, which the benchmark's workers then use
# for their float32 layers) or grpc (every push over gRPC); ALOE_BENCH_TLS = 1: mutual TLS 1.3
# between the benchmark's workers and every server process, raw pushes included (certificates
# of scripts/make-test-ca.sh in out/bench-push/ca; aloe-bench-push --tls), the raw TCP baseline
# staying plaintext; 0 or unset: plaintext;
# ALOE_BENCH_RSS_OVERHEAD_MIB = the fixed overhead of the bound (default 32: a shard process of
# this binary with a model of a few thousand parameters peaks at ~22 MiB under 4 pushers).
# shellcheck shell=bash

BENCH_PUSH_NAMES=()
BENCH_PUSH_PIDS=()
BENCH_PUSH_PREFIX=()  # command prefix of the server processes (taskset with ALOE_BENCH_PIN)
BENCH_PUSH_COORDINATOR_PREFIX=()  # the coordinator's (ALOE_BENCH_PIN's COORDINATOR)
BENCH_PUSH_DIR=""

# Prints `N` TCP ports of 127.0.0.1 that were free a moment ago (the shard processes need fixed
# ports: the coordinator tells workers their addresses).
bench_push_free_ports() {
  python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# Starts server process NAME (log $BENCH_PUSH_DIR/NAME.log, port file NAME.ports) with the given
# aloe-server flags and waits up to 30 s for its port file; returns 1 (log tail on stderr) when it
# exits or does not listen in time.
bench_push_start() {
  local name="$1"
  shift
  local prefix=(${BENCH_PUSH_PREFIX[@]+"${BENCH_PUSH_PREFIX[@]}"})
  if [ "$name" = coordinator ] && [ ${#BENCH_PUSH_COORDINATOR_PREFIX[@]} -gt 0 ]; then
    prefix=("${BENCH_PUSH_COORDINATOR_PREFIX[@]}")
  fi
  ${prefix[@]+"${prefix[@]}"} "$ALOE_BIN_DIR/aloe-server" "$@" \
    --port_file="$BENCH_PUSH_DIR/$name.ports" >"$BENCH_PUSH_DIR/$name.log" 2>&1 &
  BENCH_PUSH_NAMES+=("$name")
  BENCH_PUSH_PIDS+=("$!")
  local pid=$!
  for _ in $(seq 1 300); do
    grep -q 'grpc=[0-9]' "$BENCH_PUSH_DIR/$name.ports" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "$name did not start; the end of $BENCH_PUSH_DIR/$name.log:" >&2
  tail -n 20 "$BENCH_PUSH_DIR/$name.log" >&2
  return 1
}

# Prints each started process's peak RSS and, for the shard processes, the memory bound against
# the per-shard parameter bytes that aloe-bench-push printed (when it got that far).
bench_push_report_memory() {
  local max_staged="$1" overhead_mib="$2" i name hwm_kib bytes
  for i in "${!BENCH_PUSH_PIDS[@]}"; do
    name="${BENCH_PUSH_NAMES[$i]}"
    hwm_kib=$(awk '/^VmHWM:/ {print $2}' "/proc/${BENCH_PUSH_PIDS[$i]}/status" 2>/dev/null || true)
    if [ -z "$hwm_kib" ]; then
      echo "$name: exited before its peak RSS could be read"
      continue
    fi
    bytes=""
    if [ "${name#shard}" != "$name" ] && [ -f "$BENCH_PUSH_DIR/bench.out" ]; then
      bytes=$(sed -n "s/^shard ${name#shard} holds .* = \([0-9]*\) bytes$/\1/p" \
        "$BENCH_PUSH_DIR/bench.out")
    elif [ "$name" = server ] && [ -f "$BENCH_PUSH_DIR/bench.out" ]; then
      # The single-process server holds every layer: its bound is the whole model's.
      bytes=$(sed -n 's/^model: [0-9]* layers, \([0-9]*\) parameters.*/\1/p' \
        "$BENCH_PUSH_DIR/bench.out")
      [ -n "$bytes" ] && bytes=$((bytes * 4))
    fi
    if [ -z "$bytes" ]; then
      awk -v n="$name" -v k="$hwm_kib" 'BEGIN { printf "%s: peak RSS %.0f MiB\n", n, k / 1024 }'
      continue
    fi
    awk -v n="$name" -v k="$hwm_kib" -v b="$bytes" -v s="$max_staged" -v o="$overhead_mib" 'BEGIN {
      mib = 1048576; bound = (3 + s) * b / mib + o
      printf "%s: peak RSS %.0f MiB; parameters %.1f MiB; bound (3 + %d) x %.1f + %d = %.0f MiB: %s\n",
        n, k / 1024, b / mib, s, b / mib, o, bound, (k / 1024 <= bound) ? "PASS" : "FAIL"
    }'
  done
}

# Stops every started process (SIGTERM, SIGKILL after 10 s) and forgets it. Safe to call twice.
bench_push_stop() {
  local pid
  for pid in "${BENCH_PUSH_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${BENCH_PUSH_PIDS[@]}"; do
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  BENCH_PUSH_NAMES=()
  BENCH_PUSH_PIDS=()
}

# Usage: bench_push_run SHARDS [aloe-bench-push flags...]
# SHARDS: shard processes of the server (0 = one single-process aloe-server). Returns
# aloe-bench-push's exit status.
bench_push_run() {
  local shards="$1"
  shift
  local max_staged="${ALOE_BENCH_MAX_STAGED:-8}"
  local overhead_mib="${ALOE_BENCH_RSS_OVERHEAD_MIB:-32}"
  local transport="${ALOE_BENCH_TRANSPORT:-raw}"
  if [ "$transport" != raw ] && [ "$transport" != grpc ]; then
    echo "ALOE_BENCH_TRANSPORT: raw or grpc, got '$transport'" >&2
    return 2
  fi
  local tls="${ALOE_BENCH_TLS:-0}"
  if [ "$tls" != 0 ] && [ "$tls" != 1 ]; then
    echo "ALOE_BENCH_TLS: 0 or 1, got '$tls'" >&2
    return 2
  fi
  case "$shards$max_staged$overhead_mib" in
    *[!0-9]*)
      echo "ALOE_BENCH_SHARDS, ALOE_BENCH_MAX_STAGED, ALOE_BENCH_RSS_OVERHEAD_MIB: integers" >&2
      return 2 ;;
  esac
  local pin="${ALOE_BENCH_PIN:-}" pin_flags=()
  BENCH_PUSH_PREFIX=()
  BENCH_PUSH_COORDINATOR_PREFIX=()
  if [ -n "$pin" ]; then
    if ! [[ "$pin" =~ ^[0-9]+,[0-9]+(,[0-9]+)?$ ]]; then
      echo "ALOE_BENCH_PIN: RECEIVER,SENDER[,COORDINATOR] (CPU numbers), got '${ALOE_BENCH_PIN}'" >&2
      return 2
    fi
    local cpus
    IFS=, read -r -a cpus <<<"$pin"
    BENCH_PUSH_PREFIX=(taskset -c "${cpus[0]}")
    pin_flags=(--pin="${cpus[0]},${cpus[1]}")
    echo "pinned: server processes and TCP readers on CPU ${cpus[0]}, the benchmark's workers" \
      "and TCP writers on CPU ${cpus[1]}"
    if [ ${#cpus[@]} -eq 3 ] && [ "$shards" -gt 0 ]; then
      BENCH_PUSH_COORDINATOR_PREFIX=(taskset -c "${cpus[2]}")
      echo "pinned: the coordinator on CPU ${cpus[2]}"
    fi
  fi
  aloe_build aloe-server aloe-bench-push >/dev/null
  "$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
  BENCH_PUSH_DIR="$ALOE_ROOT/out/bench-push"
  rm -rf "$BENCH_PUSH_DIR" && mkdir -p "$BENCH_PUSH_DIR"
  trap bench_push_stop EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  echo "load average (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"

  local config="$BENCH_PUSH_DIR/server.textproto"
  cp "$ALOE_ROOT/deploy/configs/bench-push.textproto" "$config"
  # No drain on SIGTERM: the benchmark's workers have left; nothing is owed to them.
  local common=(--config="$config" --drain_seconds=0) tls_flags=()
  if [ "$tls" = 1 ]; then
    local ca="$BENCH_PUSH_DIR/ca"
    "$ALOE_ROOT/scripts/make-test-ca.sh" "$ca" >/dev/null
    printf 'security { tls_cert_file: "%s" tls_key_file: "%s" tls_client_ca_file: "%s" }\n' \
      "$ca/server.pem" "$ca/server.key" "$ca/ca.pem" >>"$config"
    tls_flags=(--tls="$ca")
    echo "TLS: mutual TLS 1.3 between the workers and the server processes (ALOE_BENCH_TLS=1)"
  fi
  local port watch
  if [ "$shards" -eq 0 ]; then
    printf 'max_staged_updates: %d\n' "$max_staged" >>"$config"
    echo "server: one aloe-server process (deploy/configs/bench-push.textproto," \
      "max_staged_updates: $max_staged)"
    echo "pushes: $transport (ALOE_BENCH_TRANSPORT)"
    local single_raw=()
    [ "$transport" = raw ] && single_raw=(--push_listen="127.0.0.1:$(bench_push_free_ports 1)")
    bench_push_start server "${common[@]}" ${single_raw[@]+"${single_raw[@]}"}
    port=$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' "$BENCH_PUSH_DIR/server.ports")
    watch="server:${BENCH_PUSH_PIDS[0]}"
  else
    printf 'shard_processes: %d\nmax_staged_updates: %d\n' "$shards" "$max_staged" >>"$config"
    echo "server: a coordinator and $shards shard process(es)" \
      "(deploy/configs/bench-push.textproto + shard_processes: $shards, max_staged_updates: $max_staged)"
    bench_push_start coordinator "${common[@]}" --role=coordinator
    port=$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' "$BENCH_PUSH_DIR/coordinator.ports")
    watch="coordinator:${BENCH_PUSH_PIDS[0]}"
    local shard_ports push_ports i raw
    read -r -a shard_ports <<<"$(bench_push_free_ports "$shards")"
    read -r -a push_ports <<<"$(bench_push_free_ports "$shards")"
    echo "pushes: $transport (ALOE_BENCH_TRANSPORT)"
    for ((i = 0; i < shards; i++)); do
      raw=()
      [ "$transport" = raw ] && raw=(--push_listen="127.0.0.1:${push_ports[$i]}")
      bench_push_start "shard$i" "${common[@]}" --role=shard --shard_index="$i" \
        --listen="127.0.0.1:${shard_ports[$i]}" --coordinator="127.0.0.1:$port" \
        ${raw[@]+"${raw[@]}"}
      watch+=",shard$i:${BENCH_PUSH_PIDS[$((i + 1))]}"
    done
  fi

  # The last line waits until the memory report is out: it stays the benchmark's last line.
  local rc=0
  "$ALOE_BIN_DIR/aloe-bench-push" --server="127.0.0.1:$port" --watch="$watch" \
    ${pin_flags[@]+"${pin_flags[@]}"} ${tls_flags[@]+"${tls_flags[@]}"} "$@" |
    tee "$BENCH_PUSH_DIR/bench.out" | sed -E '/^(ingest|egress|scale): /d' || rc=$?
  bench_push_report_memory "$max_staged" "$overhead_mib"
  bench_push_stop
  trap - EXIT INT TERM
  # Each shard process's summary at exit (layer updates copied because an older version was held).
  grep -h 'summary: shard' "$BENCH_PUSH_DIR"/shard*.log 2>/dev/null | sed 's/^.*summary: //' || true
  echo "load average at the end (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -E '^(ingest|egress|scale): ' "$BENCH_PUSH_DIR/bench.out" || true
  return "$rc"
}
