"""A prepared corpus directory (manifest.tsv and token files, docs/data.md) read the way
aloe-worker reads it: ALOE token shards, llm.c .bin and nanoGPT's uint16 .bin, memory-mapped.
"""

import os

import numpy as np
import torch

HEADER = "# name\tfile\ttokens\tsplit"
ALOE_MAGIC = b"ALOETOKS"
LLMC_MAGIC = 20240520


class DataError(ValueError):
    """A corpus file that is missing or malformed; the message names the file (and offset)."""


def read_manifest(corpus_dir):
    """Returns (properties dict, {file: (name, tokens, split)})."""
    path = os.path.join(corpus_dir, "manifest.tsv")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise DataError("%s: %s (prepare the corpus with aloe-corpus or "
                        "scripts/prepare-corpus.sh)" % (path, e.strerror)) from e
    if not lines or lines[0].rstrip("\r") != HEADER:
        raise DataError("%s: line 1: expected the header %r" % (path, HEADER))
    props, shards = {}, {}
    for number, line in enumerate(lines[1:], start=2):
        line = line.rstrip("\r")
        if not line:
            continue
        if line.startswith("# "):
            key, _, value = line[2:].partition("\t")
            props[key] = value
            continue
        fields = line.split("\t")
        if len(fields) != 4 or not fields[2].isdigit():
            raise DataError("%s: line %d: expected name, file, tokens, split" % (path, number))
        shards[fields[1]] = (fields[0], int(fields[2]), fields[3])
    return props, shards


def open_token_file(path, fmt="aloe", vocab_size=0):
    """Memory-maps a token file; returns a 1-D numpy array of uint16 or uint32 ids."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError as e:
        raise DataError("%s: %s" % (path, e.strerror)) from e
    if fmt == "aloe":
        if len(head) < 32:
            raise DataError("%s: offset %d: truncated header (32 bytes)" % (path, len(head)))
        if head[:8] != ALOE_MAGIC:
            raise DataError("%s: offset 0: bad magic (not an ALOE token shard)" % path)
        version, dtype, count, vocab = np.frombuffer(head[8:28], "<u4,<u4,<u8,<u4")[0]
        if version != 1 or dtype not in (2, 4):
            raise DataError("%s: offset 8: format version %d, dtype %d unknown" %
                            (path, version, dtype))
        if size != 32 + int(count) * int(dtype):
            raise DataError("%s: offset %d: the file holds %d bytes, its header says %d" %
                            (path, size, size, 32 + int(count) * int(dtype)))
        return np.memmap(path, "<u2" if dtype == 2 else "<u4", "r", 32, (int(count),))
    if fmt == "llmc":
        if len(head) < 1024:
            raise DataError("%s: offset %d: truncated llm.c header (1024 bytes)" %
                            (path, len(head)))
        magic, version, count = np.frombuffer(head[:12], "<i4")
        if magic != LLMC_MAGIC or version not in (1, 2):
            raise DataError("%s: offset 0: not an llm.c token file (magic %d, version %d)" %
                            (path, magic, version))
        width = 2 if version == 1 else 4
        if count <= 0 or size != 1024 + int(count) * width:
            raise DataError("%s: offset %d: %d tokens in the header, %d bytes in the file" %
                            (path, size, count, size))
        return np.memmap(path, "<u2" if width == 2 else "<u4", "r", 1024, (int(count),))
    if fmt == "uint16":
        if size == 0 or size % 2:
            raise DataError("%s: offset %d: not whole uint16 tokens" % (path, size))
        return np.memmap(path, "<u2", "r", 0, (size // 2,))
    raise DataError("%s: unknown token file format %r (aloe, llmc, uint16)" % (path, fmt))


class Corpus:
    """The token files of one corpus directory, each opened on first use and kept open."""

    def __init__(self, corpus_dir):
        self.dir = corpus_dir
        props, self.shards = read_manifest(corpus_dir)
        self.format = props.get("format", "aloe")
        self.vocab_size = int(props.get("vocab_size", "0"))
        self._open = {}

    def tokens(self, file):
        if file not in self._open:
            self._open[file] = open_token_file(os.path.join(self.dir, file), self.format,
                                               self.vocab_size)
        return self._open[file]


def sample_batch(tokens, batch_size, seq_len, generator):
    """batch_size windows of seq_len + 1 tokens (int64 [B, T + 1]), starts drawn uniformly from
    [0, n - seq_len - 1] by `generator` (a numpy Generator)."""
    n = tokens.shape[0]
    if n < seq_len + 1:
        raise DataError("a data shard of %d tokens has no window of %d" % (n, seq_len + 1))
    starts = generator.integers(0, n - seq_len, size=batch_size)
    windows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts])
    return torch.from_numpy(windows.astype(np.int64))
