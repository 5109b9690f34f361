# scripts/bench.sh scale: push latency p50/p99 and updates/s of a live aloe-server with 8, 16, 32
# and 64 concurrent simulated workers pushing 16.6 MiB updates; ratio = p99 at 64 / p50 at 16.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"
bench_push_run --mode=scale --workers=8,16,32,64 --seconds="${ALOE_BENCH_SECONDS:-10}"
