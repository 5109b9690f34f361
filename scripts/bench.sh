#!/usr/bin/env bash
# Benchmarks. Each measures its baseline in the same run, prints a table and ends with one line
# `NAME: <what> ratio=<X.XX> (<baseline>)`. One file per benchmark in scripts/bench/NAME.sh.
# Usage: scripts/bench.sh NAME
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

usage() {
  sed -n '2,4p' "$0" | sed 's/^# //'
  echo "Benchmarks:"
  for f in "$ALOE_ROOT"/scripts/bench/[!_]*.sh; do
    printf '  %-8s %s\n' "$(basename "$f" .sh)" "$(sed -n '1s/^# scripts\/bench.sh [a-z]*: //p' "$f")"
  done
}
NAME="${1:-}"
case "$NAME" in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
if [ "${NAME#_}" != "$NAME" ] || [ ! -f "$ALOE_ROOT/scripts/bench/$NAME.sh" ]; then
  echo "bench.sh: unknown benchmark '$NAME'" >&2; usage >&2; exit 2
fi

cd "$ALOE_ROOT"
"$ALOE_ROOT/scripts/install-deps.sh" >/dev/null
# The host goes with every number: the same code measures differently on two VMs of the same
# size (docs/benchmarks.md).
host_cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
host_mem=$(awk '/^MemTotal:/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
echo "host: ${host_cpu:-unknown CPU}, $(nproc) cores, $host_mem, kernel $(uname -r)"
# Not followed: scripts/lint.sh checks each benchmark file on its own.
# shellcheck source=/dev/null
. "$ALOE_ROOT/scripts/bench/$NAME.sh"
