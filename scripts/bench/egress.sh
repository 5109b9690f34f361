# scripts/bench.sh egress: GB/s of parameters ONE shard process of a layer-sharded aloe-server
# serves to 4 concurrent pullers (each pulling every layer of the latest version back to back, a
# joiner's download) vs 4 raw loopback TCP streams in the same run: ingest's other direction.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
# Environment: ALOE_BENCH_SECONDS (measured seconds of each measurement, default 15, in 3 turns:
# aloe-bench-push --repeats); ALOE_BENCH_SHARDS (shard processes, default 1; 0 = the
# single-process server); ALOE_BENCH_PIN=0,1: the servers and TCP readers on CPU 0, pullers and
# TCP writers on CPU 1 (scripts/bench/_push.sh).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"
bench_push_run "${ALOE_BENCH_SHARDS:-1}" --mode=egress --pushers=4 \
  --seconds="${ALOE_BENCH_SECONDS:-15}"
