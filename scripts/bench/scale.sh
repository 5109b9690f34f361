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
# Real rounds are not all the same length: each round's training time is drawn around the round
# with a standard deviation of ALOE_BENCH_ROUND_JITTER x round (default 0.007: the spread of a
# real aloe-worker's rounds, `scripts/demo.sh --seconds 60` on 2026-11-25, 20 steps each: 5.31 to
# 5.42 s, sd 0.037 s). With 0, every worker keeps its phase forever, so two pushes that collide
# once (and, sharing the cores, end together) collide again every round: at 64 workers 18 of 255
# pushes overlapped two or more others instead of the ~1% that independent arrivals give. The
# table after the main one shows how many pushes ran alone, beside one other or beside more, and
# their latencies: the tail is the pushes that shared the machine. Two lines follow it: the p99 of
# the pushes at 64 workers that overlapped no other, against p50 at 16 (whether the server itself
# slows down as workers are added), and the server processes' CPU time per push at 16 workers
# against the p50 latency there: near 100% means a lone push keeps the server's cores busy for
# its whole latency, so k pushes that overlap take up to k times as long on any push path.
# Takes about 6 minutes.
# Environment: ALOE_BENCH_SECONDS (measured seconds per worker count, default 60: 12 rounds, so
# p99 at 64 workers is taken over ~770 pushes; with 20 s it was the 3rd largest of ~256, and one
# noisy second of a shared host moved it: ratio 1.85-3.11 in four 20 s runs on 2026-11-26, 1.86
# and 2.02 in two 60 s runs);
# ALOE_BENCH_ROUND_SECONDS (default 5; 0 = push back to back); ALOE_BENCH_ROUND_JITTER (default
# 0.007; 0 = every round exactly ALOE_BENCH_ROUND_SECONDS); ALOE_BENCH_SHARDS (shard
# processes, default 2; 0 = the single-process server); ALOE_BENCH_MAX_STAGED (default 8).
# shellcheck shell=bash
# shellcheck source=scripts/bench/_push.sh
. "$ALOE_ROOT/scripts/bench/_push.sh"
bench_push_run "${ALOE_BENCH_SHARDS:-2}" --mode=scale --workers=8,16,32,64 \
  --round_seconds="${ALOE_BENCH_ROUND_SECONDS:-5}" \
  --round_jitter="${ALOE_BENCH_ROUND_JITTER:-0.007}" --seconds="${ALOE_BENCH_SECONDS:-60}"
