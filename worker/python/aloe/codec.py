"""How a pushed pseudo-gradient is encoded on the wire: float32, bf16 and int8 blockwise absmax,
byte for byte as the C++ encoders write them (kernels/cpu/codec_kernels.h), and the chunking
that keeps every gRPC message under 1 MiB (common/tensor_codec.h).

Every encoder takes a 1-D float32 numpy array and returns (payload bytes, residual), where the
residual is values - decode(payload) (error feedback); it raises CodecError naming the first
NaN or Inf.
"""

import numpy as np

from aloe._proto import codec_pb2

FP32 = codec_pb2.CODEC_FP32
BF16 = codec_pb2.CODEC_BF16
INT8 = codec_pb2.CODEC_INT8_BLOCKWISE
INT4 = codec_pb2.CODEC_INT4_BLOCKWISE
LOWRANK = codec_pb2.CODEC_LOWRANK
NAMES = {"fp32": FP32, "bf16": BF16, "int8": INT8}

MAX_CHUNK_BYTES = (1 << 20) - 1024  # payload bytes per chunk
INT8_HEADER_BYTES = 16
INT8_MAGIC = b"AQ8\x01"
INT8_DEFAULT_BLOCK_SIZE = 256
_SMALLEST_NORMAL = np.float32(2.0 ** -126)
_FLT_MAX = np.finfo(np.float32).max


class CodecError(ValueError):
    """A value or a buffer the codec cannot take."""


def codec_name(codec):
    return codec_pb2.Codec.Name(codec)


def _check_finite(values, who):
    bad = ~np.isfinite(values)
    if bad.any():
        i = int(np.argmax(bad))
        raise CodecError("%s: x[%d] is %s" % (who, i, values[i]))


def max_chunk_elements(codec, block_size=INT8_DEFAULT_BLOCK_SIZE):
    """The most elements one chunk of `codec` carries (whole blocks for int8)."""
    if codec == BF16:
        return MAX_CHUNK_BYTES // 2
    if codec == INT8:
        b = max(1, block_size)
        return max(1, (MAX_CHUNK_BYTES - INT8_HEADER_BYTES) // (b + 4)) * b
    if codec in (FP32, codec_pb2.CODEC_UNSPECIFIED):
        return MAX_CHUNK_BYTES // 4
    raise CodecError("codec %s is not supported by the Python worker" % codec_name(codec))


def encode_fp32(values):
    values = np.ascontiguousarray(values, dtype=np.float32)
    _check_finite(values, "fp32")
    return values.astype("<f4", copy=False).tobytes(), np.zeros_like(values)


def encode_bf16(values):
    """Round to nearest, ties to even on the 16 dropped bits; finite values beyond the largest
    bf16 saturate to +-0x7F7F instead of becoming Inf."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    _check_finite(values, "bf16")
    bits = values.view(np.uint32)
    rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint32)
    big = (bits & 0x7FFFFFFF) >= 0x7F7F8000
    out[big] = (bits[big] >> 16) & 0x8000 | 0x7F7F
    out16 = out.astype("<u2")
    decoded = (out16.astype(np.uint32) << 16).view(np.float32)
    return out16.tobytes(), values - decoded


def decode_bf16(payload):
    return (np.frombuffer(payload, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def _int8_scale(m):
    """The block scale of max |x| = m > 0 (float32), as the C++ encoder picks it."""
    scale = np.float32(m) / np.float32(127)
    if scale < _SMALLEST_NORMAL:
        # Subnormal: rounded up to the smallest float >= m / 127 (exact in float64).
        if float(scale) * 127.0 < float(m):
            scale = np.nextafter(scale, np.float32(np.inf))
        scale = max(scale, np.float32(2.0 ** -149))
    if float(scale) * 127.0 > float(_FLT_MAX):
        scale = np.nextafter(scale, np.float32(0))
    return np.float32(scale)


def encode_int8(values, block_size=INT8_DEFAULT_BLOCK_SIZE):
    """int8 blockwise absmax: header (magic, block size, n), one float32 scale per block, then
    one int8 level per value; level = rint(x * (1 / scale)) with scale = max|x| / 127."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if not 1 <= block_size <= 65536:
        raise CodecError("int8 block size %d is outside [1, 65536]" % block_size)
    _check_finite(values, "int8")
    n = values.size
    blocks = (n + block_size - 1) // block_size
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[:n] = values
    x = padded.reshape(blocks, block_size)
    m = np.abs(x).max(axis=1) if blocks else np.zeros(0, np.float32)
    scales = (m / np.float32(127)).astype(np.float32)
    # Rare blocks (max |x| below 127 * 2^-126, or FLT_MAX) take the exact scalar rule.
    odd = np.nonzero((m > 0) & ((scales < _SMALLEST_NORMAL) | (m == _FLT_MAX)))[0]
    for k in odd:
        scales[k] = _int8_scale(m[k])
    inv = np.zeros_like(scales)
    normal = scales >= _SMALLEST_NORMAL
    inv[normal] = np.float32(1) / scales[normal]
    t = x * inv[:, None]
    tiny = np.nonzero((scales > 0) & ~normal)[0]
    for k in tiny:
        t[k] = x[k] / scales[k]
    q = np.clip(np.rint(t), -127, 127).astype(np.int8)
    residual = (x - q.astype(np.float32) * scales[:, None]).reshape(-1)[:n]
    header = INT8_MAGIC + np.array([block_size], "<u4").tobytes() + np.array([n], "<u8").tobytes()
    return (header + scales.astype("<f4").tobytes() + q.reshape(-1)[:n].tobytes(), residual)


def decode_int8(payload):
    if len(payload) < INT8_HEADER_BYTES or payload[:4] != INT8_MAGIC:
        raise CodecError("int8: not an int8 blockwise buffer")
    block_size = int(np.frombuffer(payload, "<u4", 1, 4)[0])
    n = int(np.frombuffer(payload, "<u8", 1, 8)[0])
    blocks = (n + block_size - 1) // block_size
    if len(payload) != INT8_HEADER_BYTES + 4 * blocks + n:
        raise CodecError("int8: %d bytes, expected %d" %
                         (len(payload), INT8_HEADER_BYTES + 4 * blocks + n))
    scales = np.frombuffer(payload, "<f4", blocks, INT8_HEADER_BYTES)
    q = np.frombuffer(payload, np.int8, n, INT8_HEADER_BYTES + 4 * blocks)
    levels = np.maximum(q, -127).astype(np.float32)
    return levels * np.repeat(scales, block_size)[:n]


def encode(codec, values, block_size=INT8_DEFAULT_BLOCK_SIZE):
    if codec in (FP32, codec_pb2.CODEC_UNSPECIFIED):
        return encode_fp32(values)
    if codec == BF16:
        return encode_bf16(values)
    if codec == INT8:
        return encode_int8(values, block_size)
    raise CodecError("codec %s is not supported by the Python worker (fp32, bf16, int8)" %
                     codec_name(codec))


def chunks(codec, values, block_size=INT8_DEFAULT_BLOCK_SIZE):
    """Splits one layer's values into encoded chunks: yields (offset, payload, residual)."""
    step = max_chunk_elements(codec, block_size)
    for begin in range(0, max(values.size, 1), step):
        part = values[begin:begin + step]
        if part.size == 0:
            return
        payload, residual = encode(codec, part, block_size)
        yield begin, payload, residual
