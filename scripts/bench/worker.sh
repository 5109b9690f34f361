# scripts/bench.sh worker: tokens/s of a real aloe-worker (pull, H local steps, push, against a
# live aloe-server) vs a bare LibTorch loop of the same model, batch and step count; then the
# same job on a 2-rank FSDP node (aloe-worker --nproc 2, Gloo on CPU) and its scaling ratio, and
# on one worker with bf16 autocast (aloe-worker --autocast bf16) against float32.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
# shellcheck shell=bash

# Runs the benchmark job against a fresh aloe-server with one worker started with the given extra
# flags; prints the worker's tokens/s (from its closing summary; rank 0's for a node).
bench_worker_run() {
  local name="$1"
  shift
  local dir="$ALOE_ROOT/out/bench-worker/$name"
  aloe_one_worker_job "$dir" "$BENCH_CONFIG" data/sotu "$@"
  grep -o 'tokens_per_second=[0-9.]*' "$dir/worker.log" | head -1 | cut -d= -f2
}

bench_main() {
  aloe_build aloe-server aloe-worker aloe-corpus aloe-bench-worker >/dev/null
  "$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
  aloe_blas_env
  rm -rf "$ALOE_ROOT/out/bench-worker"
  BENCH_CONFIG="$ALOE_ROOT/deploy/configs/bench-worker.textproto"
  local rounds steps
  rounds=$(sed -n 's/^max_versions: *\([0-9]*\).*/\1/p' "$BENCH_CONFIG")
  steps=$(sed -n 's/^local_steps: *\([0-9]*\).*/\1/p' "$BENCH_CONFIG")

  local worker_tps node_tps bf16_tps
  worker_tps=$(bench_worker_run one)
  node_tps=$(bench_worker_run fsdp2 --nproc=2)
  bf16_tps=$(bench_worker_run bf16 --autocast=bf16)

  # The bare loop runs the same number of steps on the largest training shard.
  local shard
  shard=$(awk -F'\t' '$4 == "train" {print $3, $2}' data/sotu/manifest.tsv | sort -n | tail -1 | cut -d' ' -f2)
  local bare="$ALOE_ROOT/out/bench-worker/bare.log"
  "$ALOE_BIN_DIR/aloe-bench-worker" --steps=$((rounds * steps)) --warmup=0 --threads=1 \
    --vocab_size=256 --seq_len=128 --d_model=256 --num_layers=4 --num_heads=4 --batch_size=8 \
    --token_file="data/sotu/$shard" >"$bare" 2>&1
  local bare_tps
  bare_tps=$(grep -o 'tokens_per_second=[0-9.]*' "$bare" | tail -1 | cut -d= -f2)

  printf '%-44s %14s\n' "measurement" "tokens/s"
  printf '%-44s %14.1f\n' "aloe-worker ($rounds rounds x $steps steps)" "$worker_tps"
  printf '%-44s %14.1f\n' "aloe-worker --nproc 2 (FSDP over Gloo, CPU)" "$node_tps"
  printf '%-44s %14.1f\n' "aloe-worker --autocast bf16" "$bf16_tps"
  printf '%-44s %14.1f\n' "bare LibTorch loop ($((rounds * steps)) steps)" "$bare_tps"
  grep -o 'compute_seconds=[0-9.]* network_seconds=[0-9.]*' \
    "$ALOE_ROOT/out/bench-worker/one/worker.log" | tail -1 | sed 's/^/worker time split: /'
  awk -v n="$node_tps" -v w="$worker_tps" -v c="$(getconf _NPROCESSORS_ONLN)" 'BEGIN {
    printf "FSDP scaling, 2 ranks vs 1 process: %.2f (on %d cores, server included)\n", n / w, c }'
  awk -v h="$bf16_tps" -v w="$worker_tps" 'BEGIN {
    printf "bf16 autocast vs float32, one worker: %.2f\n", h / w }'
  awk -v w="$worker_tps" -v b="$bare_tps" 'BEGIN {
    printf "worker: tokens_per_second=%.1f ratio=%.2f (bare LibTorch %.1f tokens/s)\n", w, w / b, b }'
}

bench_main
