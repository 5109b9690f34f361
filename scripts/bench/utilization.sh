# scripts/bench.sh utilization: each worker's compute fraction across emulated long links, for
# sync DiLoCo and async DN+DyLU with a grace window, overlap off / delayed / eager.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
#
# A real aloe-server and ALOE_BENCH_WORKERS real aloe-workers (default 2), each worker behind
# its own aloe-linkemu (tools/link_emulator.h): its site's link to the server. The model is
# deploy/configs/bench-worker.textproto's (a 13 MiB fp32 update), H = ALOE_BENCH_H local steps
# (default 20). Each run lasts ALOE_BENCH_ROUNDS rounds per worker (default 6).
#
# Per worker and run the table shows its tokens/s and two compute fractions: over the whole run
# (compute seconds / wall seconds, from the worker's summary line) and in the steady state: the
# same, less the first round's wait for the network (its pull) and the last round's (its push
# and the end of the job) from the wall time, which no overlap can hide. Every other wait, for
# the network or for a sync round, counts as idle. One table
# per link. The last line gives, over the runs with overlap on a link that moves one push in
# less than a round's compute, the smallest steady-state compute fraction.
#
# Environment: ALOE_BENCH_UTIL_LINKS (RATE_MBIT:RTT_MS,..., default 100:100,1000:80);
# ALOE_BENCH_WORKERS; ALOE_BENCH_H; ALOE_BENCH_ROUNDS; ALOE_BENCH_UTIL_POLICIES (default
# sync,async-dn-dylu-grace); ALOE_BENCH_UTIL_OVERLAP (default off,delayed,eager).
# shellcheck shell=bash
util_links="${ALOE_BENCH_UTIL_LINKS:-100:100,1000:80}"
util_workers="${ALOE_BENCH_WORKERS:-2}"
util_h="${ALOE_BENCH_H:-20}"
util_rounds="${ALOE_BENCH_ROUNDS:-6}"
util_policies="${ALOE_BENCH_UTIL_POLICIES:-sync,async-dn-dylu-grace}"
util_overlaps="${ALOE_BENCH_UTIL_OVERLAP:-off,delayed,eager}"
util_window=$(aloe_link_window_kib "$util_links")

aloe_build aloe-server aloe-worker aloe-linkemu >/dev/null
"$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
aloe_blas_env
UTIL_DIR="$ALOE_ROOT/out/bench-utilization"
rm -rf "$UTIL_DIR" && mkdir -p "$UTIL_DIR"
util_pids=()
util_stop() {
  for p in "${util_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${util_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  util_pids=()
}
trap util_stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The server config of one policy: the bench-worker model and inner optimizer, stopping after
# util_rounds rounds of every worker.
util_config() {
  local policy="$1" versions
  case "$policy" in
    sync) versions=$util_rounds ;;
    *) versions=$((util_rounds * util_workers)) ;;
  esac
  sed -n '/^model /p; /^inner_optimizer /p' deploy/configs/bench-worker.textproto
  cat <<EOF
listen_address: "127.0.0.1:0"
metrics_address: "off"
corpus_dir: "data/sotu"
local_steps: $util_h
max_versions: $versions
lease_seconds: 120
eval_every: 1000000
receive_window_kib: $util_window
EOF
  case "$policy" in
    sync)
      echo "outer_optimizer { type: OUTER_NESTEROV lr: 0.7 momentum: 0.9 }"
      echo "aggregation { mode: AGGREGATION_SYNC min_workers: $util_workers }" ;;
    async-dn-dylu-grace)
      echo "outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9" \
        "dn_buffer_size: $util_workers }"
      echo "aggregation { mode: AGGREGATION_ASYNC grace_seconds: 0.5 }"
      echo "local_work { mode: LOCAL_WORK_DYLU }" ;;
    *) echo "utilization: unknown policy $policy" >&2; return 2 ;;
  esac
}

# Waits up to 30 s for FILE to hold KEY=PORT and prints PORT.
util_port() {
  local file="$1" key="$2" port=""
  for _ in $(seq 1 300); do
    port=$(sed -n "s/.*$key=\([0-9]*\).*/\1/p" "$file" 2>/dev/null)
    [ -n "$port" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || { echo "utilization: no $key port in $file" >&2; return 1; }
  echo "$port"
}

# "COMPUTE NETWORK" seconds of each round a worker log reports, one line per round (network:
# the time the round waited for the network).
util_rounds_of() {
  sed -n 's/.*\] round [0-9]*:.*(compute \([0-9.]*\)s, network \([0-9.]*\)s).*/\1 \2/p' "$1"
}

# Prints "NAME tokens/s whole steady" for one worker log.
util_summary() {
  local name="$1" log="$2" line
  line=$(sed -n 's/.*summary: //p' "$log" | tail -n 1)
  util_rounds_of "$log" | awk -v name="$name" -v line="$line" '
    { n++; b[n] = $2 }
    END {
      k = split(line, f, " ")
      for (i = 1; i <= k; i++) { split(f[i], kv, "="); s[kv[1]] = kv[2] }
      # The whole run less the two waits no overlap can hide: those of the first round (its
      # pull) and of the last (its push, and the end of the job).
      cs = s["compute_seconds"]; ws = n > 2 ? s["wall_seconds"] - b[1] - b[n] : 0
      whole = s["wall_seconds"] > 0 ? s["compute_seconds"] / s["wall_seconds"] : 0
      printf "%s %.0f %.3f %s\n", name, s["tokens_per_second"], whole,
        (ws > 0 ? sprintf("%.3f", cs / ws) : "-") }'
}

# One run: prints "worker tokens/s whole steady" per worker.
util_run() {
  local dir="$1" rate="$2" rtt="$3" policy="$4" overlap="$5"
  mkdir -p "$dir"
  util_config "$policy" >"$dir/server.textproto"
  "$ALOE_BIN_DIR/aloe-server" --config="$dir/server.textproto" --port_file="$dir/ports" \
    >"$dir/server.log" 2>&1 &
  local server=$!
  util_pids+=("$server")
  local grpc
  grpc=$(util_port "$dir/ports" grpc) || return 1
  local w workers=()
  for w in $(seq 0 $((util_workers - 1))); do
    "$ALOE_BIN_DIR/aloe-linkemu" --listen=127.0.0.1:0 --upstream="127.0.0.1:$grpc" \
      --rate_mbit="$rate" --delay_ms="$(awk -v r="$rtt" 'BEGIN { print r / 2 }')" \
      --port_file="$dir/link$w.port" >"$dir/link$w.log" 2>&1 &
    util_pids+=("$!")
    local port
    port=$(util_port "$dir/link$w.port" route0) || return 1
    "$ALOE_BIN_DIR/aloe-worker" --server="127.0.0.1:$port" --corpus_dir=data/sotu \
      --metrics=off --name="w$w" --overlap="$overlap" >"$dir/worker$w.log" 2>&1 &
    workers+=("$!")
  done
  local rc=0
  for w in "${workers[@]}"; do wait "$w" || rc=1; done
  wait "$server" || rc=1
  util_stop
  if [ "$rc" -ne 0 ]; then
    tail -n 5 "$dir"/server.log "$dir"/worker*.log >&2
    return 1
  fi
  for w in $(seq 0 $((util_workers - 1))); do
    util_summary "w$w" "$dir/worker$w.log"
  done
}

echo "load average (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg), $(nproc --all) cores"
echo "$util_workers workers, each behind its own emulated link; H = $util_h; $util_rounds rounds" \
  "per worker; receive_window_kib: $util_window"
worst=""
for link in ${util_links//,/ }; do
  rate="${link%%:*}"
  rtt="${link##*:}"
  echo
  echo "link: $rate Mbit/s, $rtt ms RTT"
  printf '%-22s %-8s %-6s %10s %10s %10s %10s\n' policy overlap worker tokens/s whole steady \
    "push s"
  for policy in ${util_policies//,/ }; do
    for overlap in ${util_overlaps//,/ }; do
      dir="$UTIL_DIR/$rate-$rtt-$policy-$overlap"
      rows=$(util_run "$dir" "$rate" "$rtt" "$policy" "$overlap") || exit 1
      while read -r worker tps whole steady; do
        # Seconds one push of the update takes at the link's rate (plus one round trip).
        bytes=$(sed -n 's/.*pushed_bytes=\([0-9]*\).*/\1/p' "$dir/worker${worker#w}.log")
        rounds=$(sed -n 's/.*summary: rounds=\([0-9]*\).*/\1/p' "$dir/worker${worker#w}.log")
        push_s=$(awk -v b="$bytes" -v n="$rounds" -v r="$rate" -v t="$rtt" \
          'BEGIN { printf "%.2f", (n > 0 ? b / n : 0) * 8 / (r * 1e6) + t / 1e3 }')
        printf '%-22s %-8s %-6s %10s %10s %10s %10s\n' "$policy" "$overlap" "$worker" "$tps" \
          "$whole" "$steady" "$push_s"
        if [ "$overlap" != off ] && [ "$steady" != - ]; then
          compute=$(util_rounds_of "$dir/worker${worker#w}.log" |
            awk '{ s += $1; n++ } END { if (n) printf "%.3f", s / n }')
          if awk -v p="$push_s" -v c="$compute" 'BEGIN { exit !(p < c) }'; then
            worst=$(printf '%s\n%s %s/%s/%s/%s\n' "$worst" "$steady" "$link" "$policy" \
              "$overlap" "$worker" | sed '/^$/d' | sort -n | head -n 1)
          fi
        fi
      done <<<"$rows"
    done
  done
done
echo
if [ -z "$worst" ]; then
  echo "utilization: no run with overlap on a link that moves a push within a round's compute"
  exit 1
fi
printf 'utilization: min steady compute fraction with overlap ratio=%.2f (%s; 1.00 = never idle)\n' \
  "${worst%% *}" "${worst#* }"
