#!/usr/bin/env python3
"""Writes the seed corpus of aloe_fuzz_push_wire (the input format is documented at the top of
tests/fuzz/push_wire_fuzzer.cc): PushChunk messages encoded by hand, cut into pieces.
Deterministic; rerun after changing the format:
    python3 tests/fuzz/make_wire_seeds.py tests/fuzz/corpus/push_wire
"""
import os
import struct
import sys


def varint(v):
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def field(number, wire, payload):
    tag = varint((number << 3) | wire)
    if wire == 0:
        return tag + varint(payload)
    if wire == 2:
        return tag + varint(len(payload)) + payload
    return tag + payload  # fixed32 / fixed64 / group markers: payload as given


def header(worker=7, task=11, update=13, base=3, steps=20, codec=0, slices=0, slice_=0):
    # PushHeader: worker_id 1, task_id 2, update_id 3, base_version 4, steps_done 5, codec 9,
    # slice 10, slices 11 (proto/parameter_service.proto).
    out = field(1, 0, worker) + field(2, 0, task) + field(3, 0, update) + field(4, 0, base)
    out += field(5, 0, steps)
    if codec:
        out += field(9, 0, codec)
    if slices:
        out += field(10, 0, slice_) + field(11, 0, slices)
    return out


def chunk(hdr=None, layer=0, offset=0, data=b"", codec=0):
    out = b""
    if hdr is not None:
        out += field(1, 2, hdr)
    if layer:
        out += field(2, 0, layer)
    if offset:
        out += field(3, 0, offset)
    if data:
        out += field(4, 2, data)
    if codec:
        out += field(5, 0, codec)
    return out


def cut(message, *positions):
    return bytes([len(positions)]) + b"".join(struct.pack("<H", p) for p in positions) + message


def seeds():
    floats = struct.pack("<8f", 0.5, -1.25, 3e-8, 0.0, 1e6, -7.75, 2.0, 1.0)
    yield "header_only", cut(chunk(header()))
    yield "header_and_chunk", cut(chunk(header(codec=1), 2, 0, floats, 1), 5, 13, 30)
    yield "chunk_fp32", cut(chunk(None, 1, 256, floats), 1, 2, 3, 4)
    yield "chunk_negative_codec", cut(chunk(None, 3, 1 << 40, b"\x01\x02", -1))
    yield "sliced_header", cut(chunk(header(slices=4, slice_=3)), 7)
    yield "fields_twice", cut(chunk(header(worker=1), 1, 0, b"abcd") +
                              chunk(header(task=2), 2, 8, b"efgh"), 9, 9)
    yield "unknown_fields", cut(chunk(None, 1, 0, floats) + field(99, 0, 5) +
                                field(100, 2, b"xyz") + field(101, 5, b"\0\0\0\0") +
                                field(102, 1, b"\0" * 8))
    yield "wrong_wire_types", cut(field(2, 5, b"\x01\0\0\0") + field(4, 0, 7) + field(1, 0, 3))
    yield "group", cut(field(4, 3, b"") + field(7, 0, 1) + field(4, 4, b""))
    yield "truncated_data", cut(field(4, 2, floats)[:-3])
    yield "long_varint", cut(b"\x18" + b"\xff" * 10 + b"\x01")
    yield "bad_header", cut(b"\x0a\x02\x08\xff")
    yield "field_zero", cut(b"\x02\x00")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "corpus", "push_wire")
    os.makedirs(out, exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
