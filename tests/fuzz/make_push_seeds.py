#!/usr/bin/env python3
"""Writes the seed corpus of aloe_fuzz_push_decoder (the input format is documented at the top of
tests/fuzz/push_decoder_fuzzer.cc). Deterministic; rerun after changing the format:
    python3 tests/fuzz/make_push_seeds.py tests/fuzz/corpus/push_decoder
"""
import os
import struct
import sys

SIZES = [3, 40, 257]  # the fuzzer's fixed ModelSpec
FP32, BF16, INT8, INT4 = 1, 2, 3, 4


def head(codec, slices=0, slice_=0):
    """The header codec (a signed byte) and the slicing bytes (0 slices = unsliced)."""
    return struct.pack("<bBB", codec, slices, slice_)


def op(layer=0, raw_offset=False, codec=0, kind=0):
    return bytes([layer | (4 if raw_offset else 0) | (codec << 3) | (kind << 6)])


def raw(layer, data, codec=0, offset=None):
    head = op(layer, offset is not None, codec, 0)
    if layer == 3:
        raise ValueError("use raw_layer")
    if offset is not None:
        head += struct.pack("<Q", offset)
    return head + struct.pack("<H", len(data)) + data


def fill(layer, count, value, codec=0):
    return op(layer, False, codec, 3) + struct.pack("<Hf", count, value)


def encoded(layer, values, codec, block=256):
    return (op(layer, False, codec, 2) + struct.pack("<HH", len(values), block) +
            struct.pack("<%df" % len(values), *values))


def int8(layer, n, block, scales, q, corruption=0):
    return (op(layer, False, INT8, 1) + struct.pack("<IHB", block, n, corruption) +
            struct.pack("<%df" % len(scales), *scales) + bytes(x & 0xff for x in q))


def int4(layer, n, block, scales, q, corruption=0):
    """A framed int4 buffer of n levels q (two per byte, value 2j in the low nibble)."""
    q = list(q) + [0] * (n % 2)
    packed = bytes((q[i] & 0xf) | ((q[i + 1] & 0xf) << 4) for i in range(0, n, 2))
    return (op(layer, False, INT4, 1) + struct.pack("<IHB", block, n, corruption) +
            struct.pack("<%df" % len(scales), *scales) + packed)


def bf16(values):
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def ramp(n):
    return [0.01 * i - 0.2 for i in range(n)]


LOWRANK = 5
LOWRANK_MAGIC = 0x4B524C41  # "ALRK"


def factor_bytes(values, codec):
    if codec == FP32:
        return struct.pack("<%df" % len(values), *values)
    if codec == BF16:
        return bf16(values)
    # INT8 and INT4: one block covering every value (an even one for int4).
    m = max(abs(v) for v in values) or 1.0
    if codec == INT8:
        scale = m / 127
        return (b"AQ8\x01" + struct.pack("<IQf", len(values), len(values), scale) +
                bytes(int(round(v / scale)) & 0xff for v in values))
    scale = m / 7
    q = [int(round(v / scale)) for v in values] + [0] * (len(values) % 2)
    return (b"AQ4\x01" + struct.pack("<IQf", len(q), len(values), scale) +
            bytes((q[i] & 0xf) | ((q[i + 1] & 0xf) << 4) for i in range(0, len(q), 2)))


def lowrank_payload(offset, rows, cols, rank, a, b, codec=FP32, q=None, p=None, q_bytes=None,
                    magic=LOWRANK_MAGIC, version=1):
    """A CODEC_LOWRANK chunk (common/low_rank_wire.h): rows [a, b) of the rows x cols tensor at
    `offset` of its layer, Q (cols x rank) and P's rows ((b - a) x rank)."""
    q = q if q is not None else [0.05 * ((j * 7 + k * 3) % 11 - 5) for j in range(cols)
                                 for k in range(rank)]
    p = p if p is not None else [0.1 * ((i * 5 + k) % 7 - 3) for i in range(a, b)
                                 for k in range(rank)]
    qb = factor_bytes(q, codec)
    return (struct.pack("<IHHQIIIIII", magic, version, codec, offset, rows, cols, rank, a, b,
                        len(qb) if q_bytes is None else q_bytes) + qb + factor_bytes(p, codec))


def lowrank(layer, payload, offset=None):
    """A record of codec 7 with the raw value CODEC_LOWRANK and a raw payload."""
    head = op(layer, offset is not None, 7, 0)
    if offset is not None:
        head += struct.pack("<Q", offset)
    return head + struct.pack("<iH", LOWRANK, len(payload)) + payload


def seeds():
    yield "valid_fp32_fill", head(0) + b"".join(fill(i, n, 0.25) for i, n in enumerate(SIZES))
    yield "valid_fp32_raw", head(FP32) + b"".join(
        raw(i, struct.pack("<%df" % n, *ramp(n))) for i, n in enumerate(SIZES))
    yield "valid_bf16_header_codec", head(BF16) + b"".join(
        raw(i, bf16(ramp(n))) for i, n in enumerate(SIZES))
    yield "valid_encoded_mixed", head(0) + encoded(0, ramp(3), INT8, 2) + \
        encoded(1, ramp(20), BF16) + encoded(1, ramp(20), FP32) + encoded(2, ramp(257), INT8, 64)
    yield "valid_int8_builder", head(INT8) + int8(0, 3, 4, [0.01], [1, -2, 127]) + \
        int8(1, 40, 16, [0.1, 0.2, 0.3], list(range(-20, 20))) + \
        int8(2, 257, 256, [1e-3, 2e-3], [i % 255 - 127 for i in range(257)])
    yield "valid_int4_builder", head(INT4) + int4(0, 3, 4, [0.01], [1, -2, 7]) + \
        int4(1, 40, 16, [0.1, 0.2, 0.3], [i % 15 - 7 for i in range(40)]) + \
        int4(2, 257, 64, [1e-3, 2e-3, 3e-3, 4e-3, 5e-3], [i % 15 - 7 for i in range(257)])
    yield "valid_encoded_int4", head(0) + encoded(0, ramp(3), INT4, 2) + \
        encoded(1, ramp(40), INT4, 16) + encoded(2, ramp(200), INT4, 64) + \
        encoded(2, ramp(57), INT4, 64)
    yield "chunks_split", head(0) + fill(2, 100, 1.0) + fill(2, 100, -1.0) + fill(2, 57, 0.5) + \
        fill(0, 3, 0.0) + fill(1, 39, 2.0) + fill(1, 1, 3.0)
    # Malformed: each of these is rejected somewhere.
    yield "unknown_layer", head(0) + op(3) + struct.pack("<I", 4242) + struct.pack("<H", 4) + \
        b"\0\0\0\0"
    yield "offset_past_end", head(0) + raw(1, b"\0" * 8, offset=39) + \
        raw(1, b"\0" * 8, offset=1 << 63)
    yield "nan_inf_fp32", head(0) + raw(0, struct.pack("<3f", 1.0, float("nan"), float("inf")))
    yield "nan_bf16", head(BF16) + raw(0, b"\x80\x3f\xc0\x7f\x80\x7f")
    yield "nan_scale_int8", head(0) + int8(0, 3, 2, [float("nan"), 1.0], [1, 2, 3]) + \
        int8(0, 3, 2, [-1.0, 1.0], [1, 2, 3]) + int8(0, 3, 2, [3e38, 1.0], [1, 2, 3])
    yield "int8_corrupt", head(0) + b"".join(
        int8(1, 40, 16, [0.1, 0.2, 0.3], [1] * 40, corruption=c) for c in range(1, 5))
    yield "nan_scale_int4", head(0) + int4(0, 3, 2, [float("nan"), 1.0], [1, 2, 3]) + \
        int4(0, 3, 2, [-1.0, 1.0], [1, 2, 3]) + int4(0, 3, 2, [1.0, float("inf")], [1, 2, 3]) + \
        int4(0, 3, 2, [5e37, 1.0], [1, 2, 3])
    yield "int4_corrupt", head(0) + b"".join(
        int4(0, 3, 2, [0.1, 0.2], [1, -8, 3], corruption=c) for c in range(1, 6))
    yield "int4_odd_block", head(INT4) + int4(1, 40, 15, [0.1, 0.2, 0.3], [1] * 40) + \
        encoded(1, ramp(40), INT4, 15)
    yield "huge_finite", head(0) + fill(0, 3, 3.0e38) + raw(0, bf16([1.0, 3.0e38, 1.0]), BF16)
    yield "unknown_codec", head(0x7f) + fill(0, 3, 1.0) + op(0, False, 7, 0) + \
        struct.pack("<iH", -5, 4) + b"\0" * 4
    yield "truncated_odd", head(0) + raw(2, b"\0" * 7) + raw(2, b"\0" * 3, BF16)
    # Sliced pushes: slice 1 of 3 of every layer ([1, 2), [14, 28), [86, 172)), a chunk that
    # runs past its slice ([172, 257) of the head), a chunk at offset 0 instead of the slice's
    # start, and 200 slices (slice 100: [200, 202) of the head, empty for the other layers).
    yield "sliced_valid", head(0, 3, 1) + fill(0, 1, 0.5) + fill(1, 14, 0.25) + \
        raw(2, struct.pack("<86f", *ramp(86)))
    yield "sliced_past_end", head(0, 3, 2) + fill(0, 1, 0.5) + fill(1, 12, 0.5) + \
        fill(2, 86, 1.0) + fill(2, 85, 1.0)
    yield "sliced_wrong_offset", head(0, 3, 1) + raw(0, struct.pack("<f", 1.0), offset=0) + \
        fill(0, 1, 1.0) + fill(1, 14, 1.0) + fill(2, 86, 1.0)
    yield "sliced_many", head(BF16, 200, 100) + fill(2, 2, 1.0, FP32) + raw(2, bf16([1.0]))
    yield "oversized", head(0) + fill(0, 4, 1.0) + fill(1, 41, 1.0) + fill(2, 60000, 1.0)
    # CODEC_LOWRANK: blocks.0 is b [4] then w [6, 6] at offset 4; head is b [1] then w [16, 16]
    # at offset 1. Valid: w of blocks.0 in one chunk, w of head in two (rows [0, 9) and
    # [9, 16)), with each factor codec.
    for name, codec in (("fp32", FP32), ("bf16", BF16), ("int8", INT8), ("int4", INT4)):
        yield "valid_lowrank_" + name, head(0) + fill(0, 3, 0.25) + fill(1, 4, 0.5) + \
            lowrank(1, lowrank_payload(4, 6, 6, 2, 0, 6, codec)) + fill(2, 1, 0.5) + \
            lowrank(2, lowrank_payload(1, 16, 16, 3, 0, 9, codec)) + \
            lowrank(2, lowrank_payload(1, 16, 16, 3, 9, 16, codec))
    # The header codec is CODEC_LOWRANK: chunks that do not name theirs are low-rank.
    yield "lowrank_header_codec", head(LOWRANK) + fill(0, 3, 0.25, FP32) + \
        fill(1, 4, 0.5, FP32) + raw(1, lowrank_payload(4, 6, 6, 6, 0, 6))
    # Malformed: each is refused.
    bad = [
        lowrank_payload(4, 6, 6, 0, 0, 6),                   # rank 0
        lowrank_payload(4, 6, 6, 7, 0, 6),                   # rank above min(rows, cols)
        lowrank_payload(4, 6, 6, 2, 0, 6)[:-4],              # truncated P
        lowrank_payload(4, 6, 6, 2, 0, 6)[:39],              # truncated header
        lowrank_payload(4, 6, 6, 2, 0, 6, q_bytes=4000),     # Q past the end
        lowrank_payload(4, 6, 6, 2, 0, 6, q=[float("nan")] * 12),
        lowrank_payload(4, 6, 6, 2, 0, 6, p=[float("inf")] * 12),
        lowrank_payload(4, 6, 6, 2, 0, 6, p=[3e38] * 12),    # the product overflows
        lowrank_payload(4, 6, 6, 2, 0, 6, q=[1.0] * 10),     # Q of another shape
        lowrank_payload(4, 6, 6, 2, 0, 6, magic=0x12345678),
        lowrank_payload(4, 6, 6, 2, 0, 6, version=2),
        lowrank_payload(4, 6, 6, 2, 0, 6, codec=LOWRANK),
        lowrank_payload(0, 6, 6, 2, 0, 6),                   # the tensor at 0 is the bias
        lowrank_payload(4, 6, 7, 2, 0, 6),                   # not the spec's shape
        lowrank_payload(4, 6, 6, 2, 2, 6),                   # rows that start elsewhere
        lowrank_payload(4, 6, 6, 2, 4, 4),                   # no rows
    ]
    yield "lowrank_malformed", head(0) + fill(0, 3, 0.25) + fill(1, 4, 0.5) + \
        b"".join(lowrank(1, p) for p in bad) + lowrank(1, lowrank_payload(4, 6, 6, 2, 0, 6))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "corpus", "push_decoder")
    os.makedirs(out, exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
