# scripts/bench.sh worker: tokens/s of a real aloe-worker (pull, H local steps, push, against a
# live aloe-server) vs a bare LibTorch loop of the same model, batch and step count.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
bench_main() {
  aloe_build aloe-server aloe-worker aloe-corpus aloe-bench-worker >/dev/null
  "$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
  aloe_blas_env
  local dir="$ALOE_ROOT/out/bench-worker"
  rm -rf "$dir" && mkdir -p "$dir"
  local config="$ALOE_ROOT/deploy/configs/bench-worker.textproto"
  local rounds steps
  rounds=$(sed -n 's/^max_versions: *\([0-9]*\).*/\1/p' "$config")
  steps=$(sed -n 's/^local_steps: *\([0-9]*\).*/\1/p' "$config")

  "$ALOE_BIN_DIR/aloe-server" --config="$config" --port_file="$dir/ports" >"$dir/server.log" 2>&1 &
  local server=$!
  trap "kill $server 2>/dev/null || true" EXIT
  for _ in $(seq 1 300); do [ -s "$dir/ports" ] && break; sleep 0.1; done
  local port
  port=$(sed -n 's/.*grpc=\([0-9]*\).*/\1/p' "$dir/ports")
  "$ALOE_BIN_DIR/aloe-worker" --server="127.0.0.1:$port" --corpus_dir=data/sotu --metrics=off \
    >"$dir/worker.log" 2>&1
  wait "$server"
  local worker_tps
  worker_tps=$(grep -o 'tokens_per_second=[0-9.]*' "$dir/worker.log" | tail -1 | cut -d= -f2)

  # The bare loop runs the same number of steps on the largest training shard.
  local shard
  shard=$(awk -F'\t' '$4 == "train" {print $3, $2}' data/sotu/manifest.tsv | sort -n | tail -1 | cut -d' ' -f2)
  "$ALOE_BIN_DIR/aloe-bench-worker" --steps=$((rounds * steps)) --warmup=0 --threads=1 \
    --vocab_size=256 --seq_len=128 --d_model=256 --num_layers=4 --num_heads=4 --batch_size=8 \
    --token_file="data/sotu/$shard" >"$dir/bare.log" 2>&1
  local bare_tps
  bare_tps=$(grep -o 'tokens_per_second=[0-9.]*' "$dir/bare.log" | tail -1 | cut -d= -f2)

  printf '%-34s %14s\n' "measurement" "tokens/s"
  printf '%-34s %14.1f\n' "aloe-worker ($rounds rounds x $steps steps)" "$worker_tps"
  printf '%-34s %14.1f\n' "bare LibTorch loop ($((rounds * steps)) steps)" "$bare_tps"
  grep -o 'compute_seconds=[0-9.]* network_seconds=[0-9.]*' "$dir/worker.log" | tail -1 | sed 's/^/worker time split: /'
  awk -v w="$worker_tps" -v b="$bare_tps" 'BEGIN {
    printf "worker: tokens_per_second=%.1f ratio=%.2f (bare LibTorch %.1f tokens/s)\n", w, w / b, b }'
}

bench_main
