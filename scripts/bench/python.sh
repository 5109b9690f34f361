# scripts/bench.sh python: tokens/s of the Python worker (worker/python/examples/train.py, the
# built-in transformer in PyTorch) vs aloe-worker, each alone against a fresh aloe-server on
# the same job (deploy/configs/bench-worker.textproto), one thread each.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
# shellcheck shell=bash

# Runs the job with one worker (ALOE_JOB_WORKER, or aloe-worker); prints the line of its log
# with its tokens/s.
bench_python_run() {
  local name="$1"
  shift
  local dir="$ALOE_ROOT/out/bench-python/$name"
  aloe_one_worker_job "$dir" "$ALOE_ROOT/deploy/configs/bench-worker.textproto" data/sotu "$@"
  cat "$dir/worker.log"
}

bench_main() {
  aloe_build aloe-server aloe-worker aloe-corpus >/dev/null
  "$ALOE_ROOT/scripts/prepare-corpus.sh" data/sotu >/dev/null
  aloe_blas_env
  rm -rf "$ALOE_ROOT/out/bench-python"
  local cpp python
  cpp=$(bench_python_run cpp --threads=1 | grep -o 'tokens_per_second=[0-9.]*' | tail -1 |
    cut -d= -f2)
  python=$(ALOE_JOB_WORKER="$ALOE_ROOT/worker/python/examples/train.py" \
    bench_python_run python --threads=1 | sed -n 's/.*(\([0-9.]*\) tokens\/s).*/\1/p' | tail -1)
  printf '%-44s %14s\n' "measurement" "tokens/s"
  printf '%-44s %14.1f\n' "aloe-worker (C++, LibTorch)" "$cpp"
  printf '%-44s %14.1f\n' "Python worker (PyTorch, examples/train.py)" "$python"
  awk -v p="$python" -v c="$cpp" 'BEGIN {
    printf "python: tokens_per_second=%.1f ratio=%.2f (aloe-worker %.1f tokens/s)\n", p, p / c, c }'
}

bench_main
