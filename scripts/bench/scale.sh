# scripts/bench.sh scale: push latency p50/p99 and updates/s of a layer-sharded aloe-server with
# 8, 16, 32 and 64 concurrent simulated workers pushing 16.3 MiB updates; ratio = p99 at 64 / p50
# at 16. Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
#
# Workers train between pushes, as real ones do: each takes a task (and tells the server it holds
# the task's base version, as aloe-worker does once it has pulled it), spends one round of
# simulated training (--round_seconds) with the task open, then pushes; its first push at a
# random phase in [0, round) (fixed seed). With --report_pulled=false (aloe-bench-push) the
# server keeps every open task's base version for the whole round, as it did before workers
# reported their pulls: at 64 workers the shards then peak at ~700 MiB instead of ~100 MiB. A closed loop that never pauses would measure only the queue: with the
# server saturated, 4x the workers means 4x the queue at the same throughput (Little's law), so
# p99 at 64 could never come near p50 at 16 on any one machine. A DiLoCo round is H local steps
# between two pushes. The default round, 5 s, is the shortest this project runs, so the most
# push-heavy: H = 20 (deploy/configs/demo.textproto) at ~3.9 steps/s, what `scripts/bench.sh
# worker` measures for a model of this size (batch 8 x 128 tokens) on one core here. H = 50
# (deploy/configs/bench-worker.textproto) would be 12.8 s, DiLoCo's own H = 500 about 2 minutes.
# A worker's first push (first round) is not measured. Each row prints the offered load (workers
# x update bytes / round, an upper bound: a worker also waits for its push) next to what was
# accepted, and the peak RSS of each server process so far (the 64 row: RSS at 64 workers).
# Takes about 2 minutes.
# Environment: ALOE_BENCH_SECONDS (measured seconds per worker count, default 20: 4 rounds);
# ALOE_BENCH_ROUND_SECONDS (default 5; 0 = push back to back); ALOE_BENCH_SHARDS (shard
# processes, default 2; 0 = the single-process server); ALOE_BENCH_MAX_STAGED (default 8).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"
bench_push_run "${ALOE_BENCH_SHARDS:-2}" --mode=scale --workers=8,16,32,64 \
  --round_seconds="${ALOE_BENCH_ROUND_SECONDS:-5}" --seconds="${ALOE_BENCH_SECONDS:-20}"
