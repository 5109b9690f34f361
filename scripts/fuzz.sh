#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, ASan + UBSan) in their own build folder and
# fuzzes each for a bounded time over a temporary copy of its seeds (tests/fuzz/corpus/<target>/
# and the saved crash inputs tests/fuzz/crashes/<target>-*), so the checkout is never written.
# Usage: scripts/fuzz.sh [--seconds N] [--target T] [-- libFuzzer flags]
#   --seconds N  fuzzing time per target, default 60
#   --target T   push_decoder, push_wire, raw_push, config, safetensors, corpus_inputs or all
#                (default)
# Build folder: $ALOE_FUZZ_BUILD_DIR, default build-fuzz/. Ends with `fuzz: N passed, M failed`
# and exits 1 when a target crashed, leaked, ran out of memory or timed out.
set -euo pipefail
# shellcheck source=scripts/lib.sh disable=SC1091
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

seconds=60
target=all
extra_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="${2:-}"; shift 2 || { usage >&2; exit 2; } ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    --target) target="${2:-}"; shift 2 || { usage >&2; exit 2; } ;;
    --target=*) target="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra_args=("$@"); break ;;
    *) echo "fuzz.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: --seconds needs a positive whole number, got '$seconds'" >&2; exit 2
fi
case "$target" in
  all) targets=(push_decoder push_wire raw_push config safetensors corpus_inputs) ;;
  push_decoder|push_wire|raw_push|config|safetensors|corpus_inputs) targets=("$target") ;;
  *) echo "fuzz.sh: unknown target '$target' (push_decoder, push_wire, raw_push, config," \
          "safetensors, corpus_inputs or all)" >&2; exit 2 ;;
esac

build_dir="${ALOE_FUZZ_BUILD_DIR:-$ALOE_ROOT/build-fuzz}"
fuzz_src="$ALOE_ROOT/tests/fuzz"
cc="${ALOE_FUZZ_CC:-clang}"
cxx="${ALOE_FUZZ_CXX:-clang++}"

# --- Configure (once) and build only the fuzz targets: LibTorch code is never compiled. ---
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz.sh: $cxx not found; install clang and libclang-rt-dev (scripts/install-deps.sh)" >&2
  exit 1
fi
if [ -f "$build_dir/CMakeCache.txt" ] &&
   ! grep -q '^ALOE_BUILD_FUZZERS:BOOL=ON' "$build_dir/CMakeCache.txt"; then
  echo "fuzz.sh: $build_dir is not a fuzz build (no ALOE_BUILD_FUZZERS=ON); use another" \
       "ALOE_FUZZ_BUILD_DIR or remove it" >&2
  exit 1
fi
mkdir -p "$build_dir"
build_log="$build_dir/fuzz-build.log"
start=$(date +%s)
if [ ! -f "$build_dir/build.ninja" ]; then
  # libFuzzer ships in Debian's libclang-rt package; say so plainly instead of a link error.
  probe="$build_dir/libfuzzer-probe"
  if ! printf 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }\n' |
       "$cxx" -fsanitize=fuzzer,address,undefined -x c++ - -o "$probe" >"$build_log" 2>&1; then
    cat "$build_log" >&2
    echo "fuzz.sh: $cxx cannot link -fsanitize=fuzzer; install libclang-rt-dev" >&2
    exit 1
  fi
  rm -f "$probe"
  aloe_log "configuring $build_dir ($cxx)"
  if ! CC="$cc" CXX="$cxx" cmake -S "$ALOE_ROOT" -B "$build_dir" -G Ninja \
         -DCMAKE_BUILD_TYPE=RelWithDebInfo -DALOE_BUILD_FUZZERS=ON -DALOE_BUILD_TESTS=OFF \
         -DALOE_ENABLE_CUDA=OFF >"$build_log" 2>&1; then
    cat "$build_log" >&2
    rm -f "$build_dir/build.ninja"
    echo "fuzz.sh: configure failed" >&2
    exit 1
  fi
fi
build_targets=()
for t in "${targets[@]}"; do build_targets+=("aloe_fuzz_$t"); done
aloe_log "building ${build_targets[*]} in $build_dir"
if ! cmake --build "$build_dir" --target "${build_targets[@]}" -- -j"$(nproc)" \
       >>"$build_log" 2>&1; then
  tail -n 60 "$build_log" >&2
  echo "fuzz.sh: build failed (full log: $build_log)" >&2
  exit 1
fi
aloe_log "build took $(( $(date +%s) - start ))s"

# --- Fuzz each target over a scratch copy of its seeds; crash inputs are kept. ---
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
if [ -z "${ASAN_SYMBOLIZER_PATH:-}" ]; then
  for s in llvm-symbolizer /usr/lib/llvm-*/bin/llvm-symbolizer; do
    if command -v "$s" >/dev/null 2>&1; then
      ASAN_SYMBOLIZER_PATH="$(command -v "$s")"; export ASAN_SYMBOLIZER_PATH; break
    fi
  done
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/aloe-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# The value after `key:` in a libFuzzer status line, or "?".
field() { sed -n "s/.* $1: *\([^ ]*\).*/\1/p" <<<"$2" | head -n 1 | grep . || echo '?'; }
stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -n 1 | grep . || echo '?'; }

passed=0
failed=0
for t in "${targets[@]}"; do
  bin="$build_dir/bin/aloe_fuzz_$t"
  corpus="$work/$t/corpus"
  artifacts="$build_dir/artifacts/$t"
  log="$build_dir/logs/$t.log"
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  if [ -d "$fuzz_src/corpus/$t" ]; then cp -R "$fuzz_src/corpus/$t/." "$corpus/"; fi
  # Inputs that once crashed run first, so a regression fails at once.
  find "$fuzz_src/crashes" -maxdepth 1 -type f -name "$t-*" -exec cp {} "$corpus/" \; \
    2>/dev/null || true
  seeds=$(find "$corpus" -type f | wc -l)
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$artifacts/")
  if [ -f "$fuzz_src/$t.dict" ]; then args+=(-dict="$fuzz_src/$t.dict"); fi
  aloe_log "$t: fuzzing for ${seconds}s from $seeds seeds (log: $log)"
  rc=0
  # libFuzzer stops itself after -max_total_time; the outer limit only catches a wedged run.
  (cd "$work/$t" && timeout --kill-after=10 "$(( seconds + 120 ))" \
     "$bin" "${args[@]}" ${extra_args[@]+"${extra_args[@]}"} "$corpus") >"$log" 2>&1 || rc=$?

  last=$(grep -E '^#[0-9]+[[:space:]]+[A-Z]+ .*cov: ' "$log" | tail -n 1 || true)
  summary="$(stat number_of_executed_units "$log") executions"
  summary+=" ($(stat average_exec_per_sec "$log") exec/s), cov: $(field cov "$last")"
  summary+=" ft: $(field ft "$last"), corpus $(field corp "$last") (units/bytes)"
  summary+=", peak RSS $(stat peak_rss_mb "$log") MB"
  summary+=", $(sed -n 's/^INFO: Seed: //p' "$log" | head -n 1 | sed 's/^/seed /')"
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    aloe_log "$t: PASS: $summary"
    continue
  fi
  failed=$((failed + 1))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    why="did not stop within $(( seconds + 120 ))s"
  else
    why="$(grep -m 1 -E '^SUMMARY: |ERROR: libFuzzer: |FUZZ_CHECK failed' "$log" || true)"
    why="${why%:}"
  fi
  aloe_log "$t: FAIL (exit $rc): ${why:-see the log}: $summary"
  # The report and the stack frames of the code under test (not libFuzzer's or libc's).
  grep -E '^(==[0-9]+==|SUMMARY|FUZZ_CHECK|\[libprotobuf|.*runtime error| +#[0-9]+ )' "$log" |
    grep -vE ' in (fuzzer::|__sanitizer_|__libc_|__pthread_kill|(_start|raise|abort|main) )|\(/lib/' |
    head -n 30 | cut -c 1-300 | sed 's/^/    /' || true
  input=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
  if [ -n "$input" ]; then
    echo "    input:     $input"
    echo "    reproduce: $bin $input"
    saved=""
    for f in "$fuzz_src/crashes/$t"-*; do
      if [ -f "$f" ] && cmp -s "$f" "$input"; then saved="$f"; fi
    done
    if [ -n "$saved" ]; then
      echo "    known:     the saved input ${saved#"$ALOE_ROOT"/} still fails"
    else
      echo "    keep it:   cp $input $fuzz_src/crashes/$t-<what>   (and commit it)"
    fi
  fi
  echo "    full log:  $log"
done

echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
