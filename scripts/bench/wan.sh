# scripts/bench.sh wan: push and pull goodput of a 64 MiB update across emulated long links
# (gRPC and raw pushes, gRPC pulls) vs raw TCP over the same link in the same run.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
#
# One aloe-server (plain async mode, outer SGD, a two-block model whose fp32 update is
# ALOE_BENCH_WAN_MIB) takes gRPC and raw pushes (--push_listen); aloe-bench-wan
# (tests/bench/wan_bench_main.cc) puts an emulated link (tools/link_emulator.h) between itself
# and the server for each link in turn and times pushes, raw pushes and pulls against a bulk raw
# TCP transfer of the same bytes over the same link. One table row per link, direction and path;
# the last line names the worst row and its ratio. With TLS rows (ALOE_BENCH_TLS, default 1) a
# second aloe-server with the same config plus mutual TLS (certificates of scripts/make-test-ca.sh
# in out/bench-wan/ca) takes gRPC and raw pushes too, and the benchmark's TLS workers push to it
# over gRPC and raw and pull from it over gRPC, through the same emulated link; the raw TCP
# baseline stays plaintext.
#
# The server sizes its HTTP/2 receive windows from the bandwidth-delay product it measures
# (receive_window_probe), starting from twice the largest one among the links
# (receive_window_kib): the window updates that cross back while a window is in flight must
# never let the sender run dry (docs/operations.md, long links).
# A pull's receive windows are the worker's: its pulls go in ALOE_BENCH_WAN_PULL_STREAMS
# concurrent parts (default 4), each one slice of every layer on a connection of its own, which
# fill the link while gRPC's probing still grows each connection's window.
# The emulated TCP window per connection is that of hosts tuned for long links (64 MiB).
#
# Environment: ALOE_BENCH_WAN_MIB (update size, default 64); ALOE_BENCH_WAN_LINKS
# (RATE_MBIT:RTT_MS,..., default 100:100,1000:80,2500:20); ALOE_BENCH_REPEATS (measured transfers
# of each kind per link, default 3); ALOE_BENCH_WAN_WINDOW_KIB (the server's receive_window_kib;
# default from the links as above); ALOE_BENCH_WAN_PROBE (the server's receive_window_probe,
# default true; false measures the fixed windows); ALOE_BENCH_WAN_PULL_STREAMS (streams per
# pull, default 4; 1 = one stream); ALOE_BENCH_TLS (1, the default: TLS rows as
# above; 0: plaintext rows only).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"

wan_mib="${ALOE_BENCH_WAN_MIB:-64}"
wan_links="${ALOE_BENCH_WAN_LINKS:-100:100,1000:80,2500:20}"
wan_repeats="${ALOE_BENCH_REPEATS:-3}"
wan_probe="${ALOE_BENCH_WAN_PROBE:-true}"
wan_pull_streams="${ALOE_BENCH_WAN_PULL_STREAMS:-4}"
wan_tls="${ALOE_BENCH_TLS:-1}"
if [ "$wan_tls" != 0 ] && [ "$wan_tls" != 1 ]; then
  echo "ALOE_BENCH_TLS: 0 or 1, got '$wan_tls'" >&2
  exit 2
fi
# d_model of a two-block model (vocab 256, 128 positions) whose parameters come nearest
# ALOE_BENCH_WAN_MIB of fp32: 24 d^2 + 668 d of them (common/model_spec.cc), d a multiple of 4.
wan_d=$(awk -v mib="$wan_mib" 'BEGIN {
  p = mib * 1048576 / 4; d = (-668 + sqrt(668 * 668 + 96 * p)) / 48
  d = int(d / 4 + 0.5) * 4; print (d < 4 ? 4 : d) }')
wan_window="${ALOE_BENCH_WAN_WINDOW_KIB:-$(aloe_link_window_kib "$wan_links")}"

aloe_build aloe-server aloe-bench-wan >/dev/null
"$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
BENCH_PUSH_DIR="$ALOE_ROOT/out/bench-wan"
rm -rf "$BENCH_PUSH_DIR" && mkdir -p "$BENCH_PUSH_DIR"
trap bench_push_stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "load average (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
cat >"$BENCH_PUSH_DIR/server.textproto" <<EOF
listen_address: "127.0.0.1:0"
metrics_address: "off"
corpus_dir: "data/sotu"
model { vocab_size: 256 seq_len: 128 d_model: $wan_d num_layers: 2 num_heads: 4 }
outer_optimizer { type: OUTER_SGD lr: 0.001 }
aggregation { mode: AGGREGATION_ASYNC }
apply_groups: 1
local_steps: 1
lease_seconds: 600
eval_every: 1000000
max_staged_updates: 2
receive_window_kib: $wan_window
receive_window_probe: $wan_probe
EOF
echo "server: one aloe-server process, d_model $wan_d (two blocks), receive_window_kib: $wan_window," \
  "receive_window_probe: $wan_probe, raw pushes on (--push_listen);" \
  "$wan_pull_streams streams per pull"
bench_push_start server --config="$BENCH_PUSH_DIR/server.textproto" --drain_seconds=0 \
  --push_listen="127.0.0.1:$(bench_push_free_ports 1)"
wan_port=$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' "$BENCH_PUSH_DIR/server.ports")
wan_tls_flags=()
if [ "$wan_tls" = 1 ]; then
  "$ALOE_ROOT/scripts/make-test-ca.sh" "$BENCH_PUSH_DIR/ca" >/dev/null
  cp "$BENCH_PUSH_DIR/server.textproto" "$BENCH_PUSH_DIR/server-tls.textproto"
  printf 'security { tls_cert_file: "%s" tls_key_file: "%s" tls_client_ca_file: "%s" }\n' \
    "$BENCH_PUSH_DIR/ca/server.pem" "$BENCH_PUSH_DIR/ca/server.key" "$BENCH_PUSH_DIR/ca/ca.pem" \
    >>"$BENCH_PUSH_DIR/server-tls.textproto"
  echo "TLS rows: a second aloe-server, the same config plus mutual TLS 1.3, raw pushes on" \
    "(ALOE_BENCH_TLS=1)"
  bench_push_start server-tls --config="$BENCH_PUSH_DIR/server-tls.textproto" --drain_seconds=0 \
    --push_listen="127.0.0.1:$(bench_push_free_ports 1)"
  wan_tls_flags=(--tls_server="127.0.0.1:$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' \
    "$BENCH_PUSH_DIR/server-tls.ports")" --tls="$BENCH_PUSH_DIR/ca")
fi
wan_rc=0
"$ALOE_BIN_DIR/aloe-bench-wan" --server="127.0.0.1:$wan_port" --links="$wan_links" \
  --repeats="$wan_repeats" --pull_streams="$wan_pull_streams" ${wan_tls_flags[@]+"${wan_tls_flags[@]}"} | tee "$BENCH_PUSH_DIR/bench.out" | sed '/^wan: /d' || wan_rc=$?
bench_push_stop
trap - EXIT INT TERM
echo "load average at the end (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg)"
grep '^wan: ' "$BENCH_PUSH_DIR/bench.out" || true
[ "$wan_rc" -eq 0 ]
