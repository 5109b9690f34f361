#!/usr/bin/env python3
"""Writes the seed corpus of aloe_fuzz_corpus_inputs (tests/fuzz/corpus/corpus_inputs/): token
files (ALOE token shards, llm.c .bin, nanoGPT's headerless uint16 .bin; common/token_shard.h)
and .jsonl files (common/corpus_inputs.h), valid ones and one file per kind of malformed one.
The fuzzer reads every input in every format. Deterministic; rerun after changing a format."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "corpus_inputs")

LLMC_MAGIC = 20240520


def aloe(tokens, vocab, dtype=None, magic=b"ALOETOKS", version=1, count=None, reserved=0):
    dtype = dtype or (2 if vocab <= 65536 else 4)
    body = struct.pack(f"<{len(tokens)}{'H' if dtype == 2 else 'I'}", *tokens)
    header = magic + struct.pack("<IIQII", version, dtype, len(tokens) if count is None else count,
                                 vocab, reserved)
    return header + body


def llmc(tokens, count=None, magic=LLMC_MAGIC, version=1):
    header = struct.pack("<iii", magic, version, len(tokens) if count is None else count)
    header += b"\0" * (1024 - len(header))
    return header + struct.pack(f"<{len(tokens)}{'H' if version == 1 else 'I'}", *tokens)


def uint16(tokens):
    return struct.pack(f"<{len(tokens)}H", *tokens)


SEEDS = {
    "aloe_uint16": aloe([0, 1, 255, 65535, 42, 7], 65536),
    "aloe_uint32": aloe([0, 65536, 99999, 3], 100000),
    "aloe_gpt2": aloe([50256, 15496, 995, 0], 50257),
    "aloe_empty": aloe([], 256),
    "aloe_wide_small_vocab": aloe([1, 2], 256, dtype=4),
    "aloe_token_out_of_range": aloe([1, 300, 2], 256),
    "aloe_bad_magic": aloe([1], 256, magic=b"ALOETOKZ"),
    "aloe_bad_version": aloe([1], 256, version=2),
    "aloe_bad_dtype": aloe([1], 256, dtype=3),
    "aloe_zero_vocab": aloe([1], 0, dtype=2),
    "aloe_truncated_body": aloe([1, 2, 3, 4, 5], 256)[:-4],
    "aloe_huge_count": aloe([1, 2], 256, count=(1 << 63) + 2),
    "aloe_truncated_header": aloe([1], 256)[:20],
    "llmc_gpt2": llmc([50256, 15496, 995, 0]),
    "llmc_version2": llmc([128000, 7], version=2),
    "llmc_out_of_range": llmc([1, 2, 50257, 60000]),
    "llmc_bad_magic": llmc([1, 2], magic=20240521),
    "llmc_bad_version": llmc([1, 2], version=7),
    "llmc_zero_count": llmc([1, 2], count=0),
    "llmc_negative_count": llmc([1, 2], count=-5),
    "llmc_truncated_body": llmc([1, 2], count=3) + b"x",
    "llmc_trailing_bytes": llmc([1, 2, 3], count=2),
    "llmc_truncated_header": llmc([1, 2])[:1000],
    "uint16_tokens": uint16([3, 64, 0, 12, 50256]),
    "uint16_odd": uint16([3, 64]) + b"\x01",
    "uint16_one_byte": b"\x01",
    "jsonl_docs": (b'{"id": 1, "text": "first \\"doc\\"\\nline two", "meta": {"a": [1, '
                   b'{"b": null}]}}\n\n'
                   b'  {"text": "caf\\u00e9 \\ud83d\\ude00", "score": -1.5e3, "ok": true}\r\n'
                   b'{"body": "x", "text": "third"}'),
    "jsonl_raw_utf8": '{"text": "na\u00efve \u65e5\u672c"}\n{"text": ""}\n'.encode(),
    "jsonl_text_twice": b'{"text": "a", "text": "b"}\n',
    "jsonl_escapes": b'{"text": "\\/\\b\\f\\r\\t\\u0000\\u001f"}\n',
    "jsonl_nested": b'{"x": [[[[{"y": [true, false, null, 1e-3]}]]]], "text": "deep"}\n',
    "jsonl_truncated": b'{"text": "ok"}\n{"text": "cut',
    "jsonl_not_string": b'{"text": 5}\n',
    "jsonl_array": b'["text"]\n',
    "jsonl_trailing": b'{"text": "a"} {"text": "b"}\n',
    "jsonl_bad_escape": b'{"text": "bad \\q escape"}\n',
    "jsonl_no_colon": b'{"text" "x"}\n',
    "jsonl_no_field": b'{"body": "x"}\n',
    "jsonl_lone_surrogate": b'{"text": "\\ud83d x"}\n',
    "jsonl_control_char": b'{"text": "a\tb"}\n',
    "jsonl_too_deep": b'{"x": ' + b"[" * 300 + b"]" * 300 + b', "text": "t"}\n',
}

os.makedirs(OUT, exist_ok=True)
for name, data in SEEDS.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
print(f"{len(SEEDS)} seeds in {OUT}")
