#!/usr/bin/env python3
"""Writes the seed corpus of aloe_fuzz_raw_push (tests/fuzz/corpus/raw_push/): raw push
preludes and replies (common/raw_push.h), valid ones and one file per kind of malformed one.
Deterministic; rerun after changing the wire format."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "raw_push")


def varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(number, value):
    return varint(number << 3) + varint(value)


def header(worker=7, task=11, update=3, base=41, steps=20, tokens=81920, codec=1, slices=None):
    h = field(1, worker) + field(2, task) + field(3, update) + field(4, base)
    h += field(5, steps) + field(6, tokens) + field(9, codec)
    if slices:
        h += field(10, slices[0]) + field(11, slices[1])
    return h


def prelude(token=b"", hdr=None, payload=4096, magic=b"ALRP", version=1):
    hdr = header() if hdr is None else hdr
    return (magic + struct.pack("<I", version) + struct.pack("<I", len(token)) + token +
            struct.pack("<I", len(hdr)) + hdr + struct.pack("<Q", payload))


def reply(code=0, message=b"", body=b""):
    return (struct.pack("<I", code) + struct.pack("<I", len(message)) + message +
            struct.pack("<I", len(body)) + body)


SEEDS = {
    "prelude_plain": prelude(),
    "prelude_token": prelude(token=b"worker-token-1"),
    "prelude_sliced": prelude(hdr=header(slices=(1, 4)), payload=1 << 20),
    "prelude_empty_header": prelude(hdr=b"", payload=0),
    "prelude_with_payload": prelude(payload=8) + struct.pack("<2f", 0.5, -0.25),
    "prelude_bad_magic": prelude(magic=b"PRI "),
    "prelude_bad_version": prelude(version=2),
    "prelude_long_token": prelude()[:8] + struct.pack("<I", 4097),
    "prelude_long_header": prelude()[:12] + struct.pack("<I", 65537),
    "prelude_garbage_header": prelude(hdr=b"\xff\xff\xff"),
    "prelude_truncated": prelude(token=b"abc")[:17],
    "reply_ok": reply(body=field(1, 42) + field(2, 1)),
    "reply_staged": reply(body=field(1, 41) + field(4, 1) + field(5, 2)),
    "reply_error": reply(code=3, message=b"layer 2 (head): non-finite value nan at element 5"),
    "reply_unknown_code": reply(code=17),
    "reply_long_message": struct.pack("<II", 0, 65537),
    "reply_garbage_body": reply(body=b"\xff\xff"),
}

os.makedirs(OUT, exist_ok=True)
for name, data in SEEDS.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
print(f"{len(SEEDS)} seeds in {OUT}")
