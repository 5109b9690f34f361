# scripts/bench.sh codec: GB/s of fp32 input of the bf16 / int8 / int4-blockwise codecs vs memcpy
# (256 MiB tensor, 2 threads over 1 MiB chunks), compression ratio and measured max error; and
# low-rank pushes (rank 16 and 64 of a 768 x 3072 matrix per thread, fp32 and int4 factors):
# the worker's encode, with and without the residual, and the server's chunk decode.
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root).
# shellcheck shell=bash
bench_main() {
  aloe_build aloe-bench-codec >/dev/null
  # Timings on a shared host depend on what else runs: record the load next to them.
  echo "load average (1/5/15 min): $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
  "$ALOE_BIN_DIR/aloe-bench-codec" --mib=256 --threads=2 --reps=10 --block_size=256 \
    --int4_block_size=64 --chunk_values=262144 --lowrank_rows=768 --lowrank_cols=3072 \
    --lowrank_ranks=16,64
}

bench_main
