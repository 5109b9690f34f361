#!/usr/bin/env bash
# Installs dependencies if missing, builds everything and runs every test suite under ctest
# (labels: unit, integration; gpu tests skip without a device).
# Usage: scripts/test.sh [ctest args...]   e.g. scripts/test.sh -L unit
set -euo pipefail
. "$(dirname "$0")/lib.sh"

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,4p' "$0"; exit 0
fi

"$ALOE_ROOT/scripts/install-deps.sh"
aloe_blas_env
aloe_log "building in $ALOE_BUILD_DIR"
start=$(date +%s)
aloe_build
aloe_log "build took $(( $(date +%s) - start ))s; running tests"
cd "$ALOE_BUILD_DIR"
ctest --output-on-failure --timeout 600 -j2 "$@"
