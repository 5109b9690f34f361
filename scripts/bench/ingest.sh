# scripts/bench.sh ingest: GB/s of fp32 pseudo-gradient ONE shard process of a layer-sharded
# aloe-server accepts from 4 concurrent pushers vs 4 raw loopback TCP streams in the same run.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
#
# The server is a coordinator plus shard_processes 1: the one shard process owns every layer and
# receives every byte, so the ratio is that of one shard (scripts/bench/_push.sh). Also prints
# the CPU (cores) the benchmark and each server process used while pushing, and each process's
# peak RSS against the shard memory bound.
# Environment: ALOE_BENCH_SECONDS (measured seconds of each measurement, default 15, in 3 turns:
# aloe-bench-push --repeats); ALOE_BENCH_SHARDS (shard processes, default 1; 0 = the
# single-process server); ALOE_BENCH_MAX_STAGED (default 8);
# ALOE_BENCH_PIN=0,1: the servers and TCP readers on CPU 0, pushers and TCP writers on CPU 1;
# ALOE_BENCH_PIN=0,1,2: the coordinator on CPU 2; ALOE_BENCH_TLS=1: mutual TLS 1.3 from the
# pushers to the server processes, raw pushes included (scripts/bench/_push.sh).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"
bench_push_run "${ALOE_BENCH_SHARDS:-1}" --mode=ingest --pushers=4 \
  --seconds="${ALOE_BENCH_SECONDS:-15}" --staged_slots="${ALOE_BENCH_MAX_STAGED:-8}"
