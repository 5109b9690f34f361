#!/usr/bin/env bash
# Prints, one per line, the Debian packages that provide the shared libraries the given binaries
# load (ldd, symlinks and alternatives resolved, usrmerge paths tried both ways). The Dockerfiles
# install exactly these in the runtime image, so it carries no compilers or -dev packages.
# Usage: deploy/docker/runtime-packages.sh BINARY...
set -euo pipefail

if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,5p' "$0"
  exit 2
fi

owner() {
  local path="$1" alt
  dpkg-query -S "$path" 2>/dev/null && return 0
  case "$path" in
    /usr/*) alt="${path#/usr}" ;;
    *) alt="/usr$path" ;;
  esac
  dpkg-query -S "$alt" 2>/dev/null
}

declare -A packages=()
for bin in "$@"; do
  [[ -x "$bin" ]] || { echo "runtime-packages: $bin is not an executable" >&2; exit 1; }
  if ldd "$bin" | grep -q 'not found'; then
    echo "runtime-packages: $bin has unresolved libraries:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  while read -r lib; do
    found=""
    for candidate in "$lib" "$(readlink -f "$lib")"; do
      if line="$(owner "$candidate")"; then
        found="${line%%: *}"
        break
      fi
    done
    if [[ -z "$found" ]]; then
      echo "runtime-packages: no Debian package owns $lib" >&2
      exit 1
    fi
    # "pkg:arch, other:arch" when several packages share a directory entry: take each.
    IFS=', ' read -r -a owners <<<"$found"
    for p in "${owners[@]}"; do packages["${p%%:*}"]=1; done
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }')
done
printf '%s\n' "${!packages[@]}" | sort
