# scripts/bench.sh optimizer: fused DN apply vs STREAM triad, GB/s (256 MiB tensors, 2 threads)
# Sourced by scripts/bench.sh (lib.sh loaded, cwd = repository root). What is measured and how bytes
# are counted (triad 16 B/element including the write-allocate read of a; DN 24 B/parameter: read
# theta, g, m, D, write theta, D): tests/bench/optimizer_bench_main.cc. The machine's load average
# is printed before and after, since other processes share the memory bus.
# shellcheck shell=bash
bench_main() {
  aloe_build aloe-bench-optimizer >/dev/null
  local dir="$ALOE_ROOT/out/bench-optimizer"
  rm -rf "$dir" && mkdir -p "$dir"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
  "$ALOE_BIN_DIR/aloe-bench-optimizer" --mib=256 --threads=2 --reps=12 --warmup=2 \
    | tee "$dir/bench.log"
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  local summary
  summary=$(grep '^summary ' "$dir/bench.log")
  local dn triad ratio
  dn=$(sed -n 's/.*dn_apply_gbps=\([0-9.]*\).*/\1/p' <<<"$summary")
  triad=$(sed -n 's/.*triad_gbps=\([0-9.]*\).*/\1/p' <<<"$summary")
  ratio=$(sed -n 's/.* ratio=\([0-9.]*\).*/\1/p' <<<"$summary")
  printf 'optimizer: dn_apply_gbps=%s ratio=%s (stream triad %s GB/s)\n' "$dn" "$ratio" "$triad"
}

bench_main
