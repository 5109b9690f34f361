# scripts/bench.sh ingest: GB/s of fp32 pseudo-gradient a live aloe-server (one parameter shard)
# accepts from 4 concurrent pushers vs 4 raw loopback TCP streams measured in the same run.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"
bench_push_run --mode=ingest --pushers=4 --seconds="${ALOE_BENCH_SECONDS:-10}"
