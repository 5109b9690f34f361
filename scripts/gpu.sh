#!/usr/bin/env bash
# GPU workers: builds ALOE against the CUDA LibTorch of a PyTorch installation and checks it on
# the GPUs (docs/operations.md, "GPU workers"). Debian 12's LibTorch is CPU-only; PyTorch's wheel carries a
# CUDA LibTorch with NCCL (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)').
#
# Usage:
#   scripts/gpu.sh bundle DIR   On a Debian 12 machine with its package archive: downloads into
#                               DIR the .deb files of ALOE's other build dependencies (gRPC,
#                               Protocol Buffers, Abseil, prometheus-cpp, GoogleTest, Gloo's
#                               headers, from ALOE_GLOO_SUITE, default sid: LibTorch 2.x needs
#                               newer ones than Debian 12's) and of the libraries they need,
#                               less the base system.
#                               About 25 MB: small enough to carry to a GPU machine that has
#                               PyTorch but no Debian archive.
#   scripts/gpu.sh build [DIR]  On the GPU machine: unpacks DIR's .deb files (if given) under
#                               $ALOE_BUILD_DIR/sysroot, configures $ALOE_BUILD_DIR (default
#                               build-cuda) against python3's torch and builds the worker, the
#                               server, the worker benchmark and the worker tests. Writes
#                               $ALOE_BUILD_DIR/env.sh, which sets LD_LIBRARY_PATH for them.
#   scripts/gpu.sh headers [DIR]
#                               Anywhere, no GPU: compile-checks (g++ -fsyntax-only) every
#                               LibTorch translation unit of the worker and its tests as a CUDA
#                               build compiles it, against the newest LibTorch headers Debian has
#                               (libtorch-dev of ALOE_HEADERS_SUITE, default sid, fetched once
#                               into DIR, default build-headers) and CUDA's (/usr/local/cuda's;
#                               without it nvidia-cuda-dev of the suite's non-free section, about
#                               1 GB). Catches what a newer LibTorch or the CUDA-only code would
#                               break before a GPU session. Debian has no NCCL headers: the NCCL
#                               code is not checked.
#   scripts/gpu.sh check [bench|tests|job|profile]...
#                               On that build: the GPU benchmark (tokens/s and MFU of a 124M
#                               model in bf16 autocast through the worker's trainer and a bare
#                               LibTorch loop in the same run, the bare loop once per inner-step
#                               change, and the GPU's idle share of a round); the worker tests
#                               (the GPU ones no longer skip); a real job (aloe-server and
#                               aloe-worker --device on the GPU, 4 rounds); a profile of the same
#                               model's step (scripts/gpu-profile.py: GPU time by kernel
#                               category). All four by default, in that order (the measurements
#                               first, for a session short of GPU time); a failed stage does not
#                               stop the next, and the check exits 1 naming every stage that
#                               failed.
# Environment: ALOE_BUILD_DIR (default build-cuda), PYTHON (default python3), ALOE_TORCH_PREFIX
# (a LibTorch CMake prefix instead of python's torch), ALOE_GPU_DEVICE (default cuda:0),
# ALOE_PEAK_TFLOPS, ALOE_GPU_BATCH, ALOE_GPU_SWEEP, ALOE_GPU_STEPS, ALOE_GPU_ROUND_STEPS,
# ALOE_GPU_ROUNDS, ALOE_GPU_ATTENTION, ALOE_GPU_COMPILE, ALOE_GPU_TEST_SECONDS,
# ALOE_HEADERS_SUITE.
set -euo pipefail
ALOE_BUILD_DIR="${ALOE_BUILD_DIR:-$(cd "$(dirname "$0")/.." && pwd)/build-cuda}"
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

# The build dependencies (those of scripts/install-deps.sh less LibTorch's, and re2, which
# gRPC's CMake package links by name) and the packages of the base system that the GPU machine
# has its own, newer copies of: never unpacked over it.
BUILD_PACKAGES=(protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev libgrpc-dev
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libre2-dev)
# Gloo's headers (LibTorch carries Gloo's code, not always its headers) must be as new as the
# LibTorch: its ProcessGroupGloo.hpp overrides gloo::rendezvous::Store methods (has_v2_support,
# multi_get, ...) that Debian 12's gloo of 2022 lacks. They come from a newer Debian suite.
GLOO_SUITE="${ALOE_GLOO_SUITE:-sid}"
BASE_PACKAGES='^(libc6|libc6-dev|libc-dev-bin|linux-libc-dev|libstdc\+\+6|libgcc-s1|gcc-12-base|libcrypt1|libcrypt-dev|libnsl2|libnsl-dev|libtirpc3|libtirpc-dev|libtirpc-common|rpcsvc-proto|adduser|passwd|debconf|libpam.*|libaudit.*|libselinux1|libsemanage.*|libsepol2|libcap-ng0|libdb5\.3|libpcre2-8-0|zlib1g|libzstd1|libbz2-1\.0|libgmp10|libffi8|pkgconf|pkgconf-bin|libpkgconf3)$'

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }

bundle() {
  local dir="${1:?usage: scripts/gpu.sh bundle DIR}"
  mkdir -p "$dir/partial"
  dir="$(cd "$dir" && pwd)"
  # An empty dpkg status: apt resolves the whole dependency closure, as for a bare machine.
  apt-get -q -o Dir::Cache::archives="$dir" -o Dir::State::status=/dev/null \
    -o Debug::NoLocking=1 --download-only -y --no-install-recommends \
    install "${BUILD_PACKAGES[@]}" >"$dir/apt.log" 2>&1 ||
    { cat "$dir/apt.log" >&2; exit 1; }
  gloo_headers "$dir"
  rmdir "$dir/partial" 2>/dev/null || true
  local kept=0 dropped=0 deb name
  for deb in "$dir"/*.deb; do
    name="$(dpkg-deb -f "$deb" Package)"
    if [[ "$name" =~ $BASE_PACKAGES ]]; then
      rm "$deb"; dropped=$((dropped + 1))
    else
      kept=$((kept + 1))
    fi
  done
  aloe_log "bundle: $kept packages in $dir ($(du -sh "$dir" | cut -f1)); $dropped base-system packages left out"
}

# apt_download DIR SUITE COMPONENTS PACKAGE...: downloads the packages' .deb files of Debian's
# SUITE (COMPONENTS: e.g. "main non-free") into DIR, from the mirror this machine's apt uses,
# signed by Debian's archive keyring, through apt lists of its own (the system's are left alone).
apt_download() {
  local dir="$1" suite="$2" components="$3" uri
  shift 3
  uri="$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -v security | head -1)"
  [ -n "$uri" ] || uri="$(awk '$1 == "deb" && $3 ~ /^bookworm$/ { print $2; exit }' \
    /etc/apt/sources.list 2>/dev/null)"
  [ -n "$uri" ] || { echo "gpu.sh: no Debian mirror found in /etc/apt's sources" >&2; exit 1; }
  local apt="$dir/.apt-$suite"
  mkdir -p "$apt/lists/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $suite $components" \
    >"$apt/sources.list"
  local o=(-o Dir::Etc::SourceList="$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o Dir::State::Lists="$apt/lists" -o Debug::NoLocking=1)
  { apt-get -q "${o[@]}" update && (cd "$dir" && apt-get -q "${o[@]}" download "$@"); } \
    >>"$dir/apt.log" 2>&1 || { cat "$dir/apt.log" >&2; exit 1; }
  rm -rf "$apt"
}

# Gloo's headers of $GLOO_SUITE into DIR, for the bundle.
gloo_headers() {
  apt_download "$1" "$GLOO_SUITE" main libgloo-dev
  aloe_log "bundle: Gloo's headers from $GLOO_SUITE: $(cd "$1" && ls libgloo-dev_*.deb)"
}

# headers [DIR]: the compile check against a newer LibTorch's and CUDA's headers (usage above).
headers() {
  local dir="${1:-$ALOE_ROOT/build-headers}" suite="${ALOE_HEADERS_SUITE:-sid}"
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  local root="$dir/root" version_h="usr/include/torch/csrc/api/include/torch/version.h"
  local cuda_include=/usr/local/cuda/include components=main packages=(libtorch-dev libgloo-dev)
  if [ ! -f "$cuda_include/cuda_runtime_api.h" ]; then
    cuda_include="$root/usr/include"
    components="main non-free"
    packages+=(nvidia-cuda-dev libcu++-dev)
  fi
  if [ ! -f "$root/$version_h" ] || [ ! -f "$cuda_include/cuda_runtime_api.h" ]; then
    aloe_log "headers: fetching ${packages[*]} of $suite"
    rm -rf "$root" "$dir"/*.deb
    apt_download "$dir" "$suite" "$components" "${packages[@]}"
    mkdir -p "$root"
    local deb
    for deb in "$dir"/*.deb; do
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$root" --wildcards './usr/include/*'
    done
    rm -f "$dir"/*.deb
    # Generated by a CUDA build of LibTorch; Debian's CPU-only build does not ship it.
    mkdir -p "$root/usr/include/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' \
      >"$root/usr/include/c10/cuda/impl/cuda_cmake_macros.h"
  fi
  local torch_version
  torch_version="$(grep -rhE '^#define TORCH_VERSION_(MAJOR|MINOR|PATCH) ' \
    "$root/usr/include/torch" | awk '{ print $3 }' | paste -sd.)"
  # The generated protocol headers come from the CPU build.
  local cpu_build="$ALOE_ROOT/build"
  [ -f "$cpu_build/build.ninja" ] ||
    cmake -S "$ALOE_ROOT" -B "$cpu_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$cpu_build" -- aloe_proto_grpc >/dev/null
  local flags=(-std=c++20 -fsyntax-only -DALOE_WITH_TORCH_CUDA=1 -DUSE_C10D_GLOO=1
    '-DALOE_BIN_DIR=""' '-DALOE_SOURCE_DIR=""' -I"$ALOE_ROOT" -I"$cpu_build"
    -I"$root/usr/include" -I"$root/usr/include/torch/csrc/api/include" -I"$cuda_include")
  local files
  mapfile -t files < <(cd "$ALOE_ROOT" && git ls-files 'worker/*.cc' 'tests/unit/worker/*.cc' \
    'tests/bench/*.cc' 'tests/integration/*.cc' | grep -v '^worker/python/')
  aloe_log "headers: checking ${#files[@]} files against LibTorch $torch_version and the CUDA headers in $cuda_include"
  local log="$dir/check.log"
  : >"$log"
  # shellcheck disable=SC2016 # the inner shell expands its own variables
  printf '%s\n' "${files[@]}" | (cd "$ALOE_ROOT" && xargs -P "$(nproc)" -I{} sh -c \
    'e=$(mktemp); g++ "$@" {} >/dev/null 2>"$e" || { echo "FAIL {}"; cat "$e"; }; rm -f "$e"' \
    _ "${flags[@]}") >>"$log" 2>&1
  local failed
  failed="$(grep -c '^FAIL ' "$log" || true)"
  if [ "$failed" -gt 0 ]; then
    grep -E '^FAIL |error' "$log" | head -60 >&2
    echo "gpu.sh: $failed of ${#files[@]} files fail to compile against LibTorch $torch_version (all in $log)" >&2
    exit 1
  fi
  aloe_log "headers: all ${#files[@]} files compile against LibTorch $torch_version and CUDA's headers"
}

torch_prefix() {
  if [ -n "${ALOE_TORCH_PREFIX:-}" ]; then
    echo "$ALOE_TORCH_PREFIX"
    return
  fi
  "${PYTHON:-python3}" -c 'import torch; print(torch.utils.cmake_prefix_path)'
}

build() {
  local debs="${1:-}"
  local sysroot="$ALOE_BUILD_DIR/sysroot"
  mkdir -p "$ALOE_BUILD_DIR"
  local prefixes
  prefixes="$(torch_prefix)"
  local torch_dir="$prefixes"
  if [ -n "$debs" ]; then
    rm -rf "$sysroot"
    mkdir -p "$sysroot"
    local deb count=0
    for deb in "$debs"/*.deb; do
      dpkg-deb -x "$deb" "$sysroot"
      count=$((count + 1))
    done
    [ "$count" -gt 0 ] || { echo "gpu.sh: no .deb files in $debs" >&2; exit 1; }
    aloe_log "unpacked $count packages under $sysroot"
    # Absolute symlinks in the packages point into /usr: point them into the sysroot.
    find "$sysroot" -type l -lname '/*' | while read -r link; do
      ln -sfn "$sysroot$(readlink "$link")" "$link"
    done
    prefixes="$sysroot/usr;$prefixes"
    # A LibTorch that ships Gloo's headers builds against its own.
    if [ -d "$torch_dir/../../include/gloo" ] && [ -d "$sysroot/usr/include/gloo" ]; then
      rm -rf "$sysroot/usr/include/gloo"
      aloe_log "using the Gloo headers of LibTorch ($(cd "$torch_dir/../../include" && pwd)/gloo)"
    fi
  fi
  {
    echo "# Sourced before running what $ALOE_BUILD_DIR built (scripts/gpu.sh)."
    if [ -n "$debs" ]; then
      echo "export LD_LIBRARY_PATH=\"$sysroot/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
      # gRPC's CMake package links re2 by name (-lre2): the linker looks here after -L.
      echo "export LIBRARY_PATH=\"$sysroot/usr/lib/x86_64-linux-gnu\${LIBRARY_PATH:+:\$LIBRARY_PATH}\""
      echo "export PATH=\"$sysroot/usr/bin:\$PATH\""
    fi
  } >"$ALOE_BUILD_DIR/env.sh"
  # shellcheck source=/dev/null
  . "$ALOE_BUILD_DIR/env.sh"
  aloe_log "configuring $ALOE_BUILD_DIR against LibTorch at $torch_dir"
  cmake -S "$ALOE_ROOT" -B "$ALOE_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$prefixes" | grep -E 'ALOE|Torch|CUDA' || true
  grep -q 'ALOE_NCCL_INCLUDE_DIR:PATH=/' "$ALOE_BUILD_DIR/CMakeCache.txt" ||
    aloe_log "warning: no nccl.h found: a multi-rank GPU node will have no NCCL group"
  # -k 0: one build reports every file that fails, not only the first.
  cmake --build "$ALOE_BUILD_DIR" -- -k 0 -j"$(nproc)" aloe-worker aloe-server aloe-corpus \
    aloe-bench-worker aloe_worker_tests aloe_integration_tests
  aloe_log "built in $ALOE_BUILD_DIR; . $ALOE_BUILD_DIR/env.sh before running its binaries"
}

# Each test binary under a time limit (ALOE_GPU_TEST_SECONDS, default 600): a collective that
# never returns (as an NCCL group destroyed without shutdown once did) fails the check by name
# instead of holding the machine.
check_tests() {
  local limit="${ALOE_GPU_TEST_SECONDS:-600}"
  timeout "$limit" "$ALOE_BUILD_DIR/bin/aloe_worker_tests" \
    --gtest_filter='*Gpu*:*Nccl*:TrainerDevice*:FsdpTrainerTest.*:LocalTrainerTest.*:RoundBoundaryTest.*:LinearCrossEntropyTest.*:StepGraphTest.*:InnerAdamWTest.*' ||
    { echo "gpu.sh: aloe_worker_tests failed or ran past ${limit} s" >&2; exit 1; }
  # A GPU worker against a real server, against the same job on the CPU.
  timeout "$limit" "$ALOE_BUILD_DIR/bin/aloe_integration_tests" --gtest_filter='FsdpWorkerTest.*' ||
    { echo "gpu.sh: aloe_integration_tests failed or ran past ${limit} s" >&2; exit 1; }
}

# A GPT-2-small-sized model (12 layers of width 768, 1024 tokens, vocabulary 24576: 124M
# parameters) in bf16 autocast, its model FLOPs utilisation against ALOE_PEAK_TFLOPS (default
# 989: H100 SXM dense bf16; 989 also for an H200). The bare LibTorch loop runs once per change to
# the inner step, each added to the ones before it (worker/inner_adamw.h), so that each is
# measured on its own, at ALOE_GPU_BATCH (default 16) sequences a step: LibTorch's AdamW and
# clip with the host waiting for the device twice a step; then the multi-tensor AdamW; the fused
# AdamW kernel; the one-pass clip folded into it; the host no longer waiting each step; the head
# and loss fused in row chunks (worker/linear_cross_entropy.h); the whole step as one CUDA graph
# (worker/step_graph.h). The last two run against the worker's trainer in the same run, with the
# same CUDA graph setting (their ratio), and each then times ALOE_GPU_ROUNDS (default 2)
# overlapped rounds of ALOE_GPU_ROUND_STEPS (default 100) steps through the host and the device
# round boundary against the same steps in one call: the GPU's idle time per round. Then the
# whole step with each attention kernel of ALOE_GPU_ATTENTION (default "cudnn efficient"; the
# runs before take LibTorch's own choice, FlashAttention), and computed in bf16 throughout
# with float32 master parameters (--bare_precision=bf16: what dropping autocast's float32
# activations would gain). Last, the whole step and the trainer at each batch of ALOE_GPU_SWEEP
# (default "32 64"; "" for none). Each bare loop line gives its mean loss: a variant that
# computes something else stands out.
check_bench() {
  local peak="${ALOE_PEAK_TFLOPS:-989}" log="$ALOE_BUILD_DIR/gpu-bench.log"
  local batch="${ALOE_GPU_BATCH:-16}" rounds=(--round_steps="${ALOE_GPU_ROUND_STEPS:-100}"
    --rounds="${ALOE_GPU_ROUNDS:-2}")
  local variants=("libtorch libtorch step unfused false" "foreach libtorch step unfused false"
    "fused libtorch step unfused false" "fused one_pass step unfused false"
    "fused one_pass round unfused false" "fused one_pass round fused false"
    "fused one_pass round fused true")
  : >"$log"
  local v first_trainer=$((${#variants[@]} - 2)) i=0 failed=0
  for v in "${variants[@]}"; do
    if [ "$i" -ge "$first_trainer" ]; then
      bench_run "$batch" "$v" --trainer "${rounds[@]}" || failed=1
    else
      bench_run "$batch" "$v" || failed=1
    fi
    i=$((i + 1))
  done
  # The whole step with each other attention kernel (the variants run LibTorch's own choice),
  # then computed in bf16 throughout with float32 master parameters instead of autocast.
  local a
  for a in ${ALOE_GPU_ATTENTION-cudnn efficient}; do
    bench_run "$batch" "${variants[${#variants[@]} - 1]} $a" || failed=1
  done
  bench_run "$batch" "${variants[${#variants[@]} - 1]} auto bf16" || failed=1
  local b
  for b in ${ALOE_GPU_SWEEP-32 64}; do
    bench_run "$b" "${variants[${#variants[@]} - 1]}" --trainer || failed=1
  done
  awk -v peak="$peak" '
    function fields(   i, kv) { delete v; for (i = 1; i <= NF; ++i) { split($i, kv, "="); v[kv[1]] = kv[2] } }
    /^bare_step/ { fields(); step = "batch " v["batch"] ", " v["adamw"] " adamw, " v["clip"] " clip, host waits each " v["sync"] ", " v["loss"] " loss, attention " v["attention"] ", " v["precision"] ", graph " }
    /^bare_libtorch/ { fields(); printf "gpu: bare loop, %-108s tokens_per_second=%s mfu=%s loss=%s%s\n",
      step v["graph"], v["tokens_per_second"], v["mfu"], v["loss"], prev ? sprintf(" (x%.3f)", v["tokens_per_second"] / prev) : "";
      prev = v["tokens_per_second"] }
    /^aloe_trainer/ { fields(); graph = v["graph"]; printf "gpu: trainer (graph %s) tokens_per_second=%s mfu=%s (peak %s TFLOP/s) ratio=%s (bare loop of the same step) loss=%s\n",
      graph, v["tokens_per_second"], v["mfu"], peak, v["ratio"], v["loss"] }
    /^aloe_round/ { fields(); printf "gpu: %s rounds of %s steps, %s boundary, graph %s: %s s a round, the GPU idle %s s of it (%.2f%%)\n",
      v["rounds"], v["round_steps"], v["boundary"], graph, v["round_seconds"], v["idle_seconds"], 100 * v["idle_fraction"] }' "$log"
  return "$failed"
}

# bench_run BATCH "ADAMW CLIP SYNC LOSS GRAPHS [ATTENTION [PRECISION]]" [FLAG...]: one
# aloe-bench-worker run of the 124M model into check_bench's log; fails (after logging which)
# when the run does.
bench_run() {
  local batch="$1" adamw clip sync loss graphs attention precision
  read -r adamw clip sync loss graphs attention precision <<<"$2"
  attention="${attention:-auto}" precision="${precision:-autocast}"
  shift 2
  "$ALOE_BUILD_DIR/bin/aloe-bench-worker" --device="$DEVICE" --autocast=bf16 \
    --vocab_size=24576 --seq_len=1024 --d_model=768 --num_layers=12 --num_heads=12 \
    --batch_size="$batch" --steps="${ALOE_GPU_STEPS:-30}" --warmup=5 --threads=4 \
    --peak_tflops="${ALOE_PEAK_TFLOPS:-989}" --bare_adamw="$adamw" --bare_clip="$clip" \
    --bare_sync="$sync" --bare_loss="$loss" --cuda_graphs="$graphs" --attention="$attention" \
    --bare_precision="$precision" "$@" |
    tee -a "$ALOE_BUILD_DIR/gpu-bench.log" ||
    { aloe_log "check bench: batch $batch, $adamw $clip $sync $loss graphs=$graphs" \
      "attention=$attention precision=$precision failed"; return 1; }
}

# Where a step of the same 124M model spends the GPU's time: scripts/gpu-profile.py (PyTorch
# eager, the same ATen kernels as the trainer) under torch.profiler, by kernel category and the
# longest kernels.
# ALOE_GPU_COMPILE=MODE (a torch.compile mode, e.g. default) profiles the step compiled too: the
# gain that fusion would bring, before writing it by hand.
check_profile() {
  local modes=(off) mode
  [ -n "${ALOE_GPU_COMPILE:-}" ] && modes+=("$ALOE_GPU_COMPILE")
  : >"$ALOE_BUILD_DIR/gpu-profile.log"
  for mode in "${modes[@]}"; do
    "${PYTHON:-python3}" "$ALOE_ROOT/scripts/gpu-profile.py" --device="$DEVICE" \
      --batch_size="${ALOE_GPU_BATCH:-16}" --peak_tflops="${ALOE_PEAK_TFLOPS:-989}" \
      --compile="$mode" --trace="$ALOE_BUILD_DIR/gpu-profile-$mode.json" |
      tee -a "$ALOE_BUILD_DIR/gpu-profile.log" ||
      { echo "gpu.sh: the profile (compile $mode) failed" >&2; exit 1; }
  done
}

# A real job: aloe-server and one aloe-worker on the device (bf16 autocast, eager overlap through
# the device round boundary) train the worker benchmark's model (deploy/configs/bench-worker.textproto: 4 rounds of 50 steps) on a corpus
# made from this repository's own text (the GPU machine may have no other).
check_job() {
  local job="$ALOE_BUILD_DIR/gpu-job"
  rm -rf "$job"
  mkdir -p "$job/text"
  local f
  for f in "$ALOE_ROOT"/README.md "$ALOE_ROOT"/worker/*.cc "$ALOE_ROOT"/server/*/*.cc; do
    cp "$f" "$job/text/$(basename "$(dirname "$f")")_$(basename "$f").txt"
  done
  "$ALOE_BUILD_DIR/bin/aloe-corpus" --input_dir="$job/text" --output_dir="$job/corpus" \
    >"$job/corpus.log" 2>&1 || { cat "$job/corpus.log" >&2; exit 1; }
  sed "s|^corpus_dir:.*|corpus_dir: \"$job/corpus\"|" \
    "$ALOE_ROOT/deploy/configs/bench-worker.textproto" >"$job/server.textproto"
  local rc=0
  aloe_one_worker_job "$job" "$job/server.textproto" "$job/corpus" --device="$DEVICE" \
    --autocast=bf16 --overlap=eager || rc=$?
  grep -E 'training on|round boundary|CUDA graph|tokens_per_second' "$job/worker.log" |
    sed 's/^/job: /'
  if [ "$rc" -ne 0 ]; then
    echo "gpu.sh: the job failed (exit $rc)" >&2
    exit 1
  fi
}

# check [bench|tests|job|profile]...: all four by default, in that order, on ALOE_GPU_DEVICE
# (default cuda:0).
# Each stage runs in a process of its own (gpu.sh stage NAME) and a failed one does not stop the
# next: one session on a GPU reports every stage. Exits 1 naming the stages that failed.
check() {
  [ -f "$ALOE_BUILD_DIR/env.sh" ] || { echo "gpu.sh: run scripts/gpu.sh build first" >&2; exit 1; }
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  local stages=("$@") stage failed=()
  [ ${#stages[@]} -gt 0 ] || stages=(bench tests job profile)
  for stage in "${stages[@]}"; do
    case "$stage" in
      tests|bench|profile|job) ;;
      *) echo "gpu.sh: unknown check stage '$stage' (tests, bench, profile or job)" >&2; exit 2 ;;
    esac
  done
  for stage in "${stages[@]}"; do
    aloe_log "check: $stage"
    "$ALOE_ROOT/scripts/gpu.sh" stage "$stage" || failed+=("$stage")
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu.sh: check failed: ${failed[*]}" >&2
    exit 1
  fi
  aloe_log "check: ${stages[*]} passed"
}

# stage NAME: one check stage (check runs each so).
stage() {
  # shellcheck source=/dev/null
  . "$ALOE_BUILD_DIR/env.sh"
  DEVICE="${ALOE_GPU_DEVICE:-cuda:0}"
  "check_$1"
}

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  headers) shift; headers "$@" ;;
  build) shift; build "$@" ;;
  check) shift; check "$@" ;;
  stage) shift; stage "$1" ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
