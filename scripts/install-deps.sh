#!/usr/bin/env bash
# Installs everything ALOE needs on a fresh Debian 12 (bookworm) machine. Idempotent: packages
# already present are skipped, so running it again costs one dpkg query.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev libgrpc-dev
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev googletest
  libtorch-dev libgloo-dev libopenblas0-openmp
  prometheus curl openssl python3-matplotlib
  # TLS of raw pushes (common/tls_stream.h)
  libssl-dev
  # aloe-corpus --tokenizer sentencepiece; spm_encode for its golden test
  libsentencepiece-dev sentencepiece
  # tests/integration/byo_model_test.cc scripts TorchScript modules with Debian's PyTorch;
  # the Python worker (worker/python) speaks gRPC with Debian's grpcio and protobuf
  python3-torch python3-grpcio python3-protobuf
  # scripts/fuzz.sh: clang, libFuzzer and the sanitizer runtimes, llvm-symbolizer
  clang libclang-rt-dev llvm
  # scripts/lint.sh; tests/integration/deploy_flags_test.py reads the manifests with python3-yaml
  shellcheck yamllint flake8 python3-yaml clang-format
  # tests/integration/status_page_test.py opens the status page in headless Chromium
  chromium
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

# npm fetches the corpus package; the base image ships it with nodejs, Debian splits it out.
if ! command -v npm >/dev/null 2>&1; then missing+=(npm); fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

# The pthread OpenBLAS variant fights Torch's OpenMP threads; only the OpenMP one may be present.
if dpkg-query -W -f='${Status}' libopenblas0-pthread 2>/dev/null | grep -q 'install ok installed'; then
  $SUDO apt-get remove -y -qq libopenblas0-pthread
fi
echo "install-deps: done"
