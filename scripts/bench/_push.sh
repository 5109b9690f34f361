# Shared by scripts/bench/ingest.sh and scale.sh (not a benchmark: bench.sh skips files named
# _*). Starts aloe-server with deploy/configs/bench-push.textproto,
# runs aloe-bench-push against it with the given flags, stops the server.
# shellcheck shell=bash
bench_push_run() {
  aloe_build aloe-server aloe-bench-push >/dev/null
  "$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
  local dir="$ALOE_ROOT/out/bench-push"
  rm -rf "$dir" && mkdir -p "$dir"
  echo "load average (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
  "$ALOE_BIN_DIR/aloe-server" --config="$ALOE_ROOT/deploy/configs/bench-push.textproto" \
    --port_file="$dir/ports" >"$dir/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 300); do [ -s "$dir/ports" ] && break; sleep 0.1; done
  local port
  port=$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' "$dir/ports")
  local rc=0
  "$ALOE_BIN_DIR/aloe-bench-push" --server="127.0.0.1:$port" "$@" || rc=$?
  # The server's peak memory while it staged and applied the pushes.
  echo "aloe-server peak RSS: $(awk '/VmHWM/ {printf "%.0f MiB", $2 / 1024}' "/proc/$server/status")"
  kill -TERM "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  return "$rc"
}
