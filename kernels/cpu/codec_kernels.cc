#include "kernels/cpu/codec_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_format.h"

#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif

// Built with -O3 -march=x86-64-v2 and OpenMP (kernels/CMakeLists.txt), so SSE4.1 is the
// baseline. The int8 loops use SSE4.1 intrinsics (GCC's own vectorisation of the float -> int8
// conversion and of the -128 clamp was 2-5x slower); the bf16 loops are plain `omp simd` loops
// that GCC vectorises. Every SIMD loop has a scalar tail doing the same float operations, which
// is also the whole loop on a build without SSE4.1. Byte buffers are accessed through memcpy or
// unaligned loads (no alignment or aliasing assumptions). The int8 encoder makes two passes per
// block (max, then quantise) while the block is still in L1.

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire formats are little-endian");

namespace aloe::kernels {
namespace {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kExponentMask = 0x7f800000u;  // all set: NaN or Inf
constexpr uint32_t kBf16ExponentMask = 0x7f80u;
constexpr uint32_t kBf16MaxFinite = 0x7f7fu;
constexpr size_t kBf16Tile = 2048;                  // values per finiteness check in the bf16 loops
constexpr float kSmallestNormal = 1.17549435e-38f;  // 2^-126
constexpr float kFloatMax = 3.40282347e38f;         // FLT_MAX

inline uint32_t FloatBits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

inline float BitsToFloat(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Round to nearest even on the 16 dropped bits; finite values that round up to the Inf pattern
// saturate to the largest finite bf16 of their sign. Only called on finite input.
inline uint32_t Bf16FromFloatBits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return (rounded & kBf16ExponentMask) == kBf16ExponentMask ? ((rounded & 0x8000u) | kBf16MaxFinite)
                                                            : rounded;
}

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

inline float LoadF32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void StoreF32(uint8_t* p, float v) { std::memcpy(p, &v, sizeof(v)); }

const char* NonFiniteName(float v) {
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "+Inf" : "-Inf";
}

// The error for the first non-finite x[i], i in [begin, end); `what` names the operation.
absl::Status NonFiniteInputError(const char* what, const float* x, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: x[%d] is %s; only finite values can be encoded", what, i, NonFiniteName(x[i])));
    }
  }
  return absl::InternalError(absl::StrFormat("%s: non-finite value not found again", what));
}

absl::Status Bf16SizeError(const char* what, size_t in_bytes, size_t n) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %d bytes cannot hold %d bf16 values (expected %d bytes)", what, in_bytes,
                      n, Bf16EncodedSize(n)));
}

// The error for the first non-finite bf16 value in in[begin, end).
absl::Status Bf16NonFiniteError(const char* what, const uint8_t* in, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const uint32_t bits = LoadU16(in + 2 * i);
    if ((bits & kBf16ExponentMask) == kBf16ExponentMask) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: encoded value %d is %s (bits 0x%04x)", what, i,
                          NonFiniteName(BitsToFloat(bits << 16)), bits));
    }
  }
  return absl::InternalError(absl::StrFormat("%s: non-finite value not found again", what));
}

// 1 when the bf16 at in + 2 i is NaN or Inf, else 0. Branch-free for vectorised scans.
inline uint32_t Bf16NonFiniteBit(const uint8_t* in, size_t i) {
  return static_cast<uint32_t>((LoadU16(in + 2 * i) & kBf16ExponentMask) == kBf16ExponentMask);
}

// Scales are valid when 127 * scale is finite (false for NaN and Inf too). Only a block whose max
// is FLT_MAX rounds m / 127 above that; the encoder steps it down by one float.
inline bool ScaleInRange(float scale) { return scale * 127.0f <= kFloatMax; }

// A wire scale is valid when its sign bit is clear (the encoder never writes -0 either) and
// 127 * scale is finite (false for NaN and Inf too).
inline bool ScaleValid(const uint8_t* scales, size_t k) {
  const float s = LoadF32(scales + 4 * k);
  return (FloatBits(s) >> 31) == 0 && ScaleInRange(s);
}

absl::Status CheckBlockSize(const char* what, size_t block_size) {
  if (block_size < kInt8MinBlockSize || block_size > kInt8MaxBlockSize) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: block size %d outside [%d, %d]", what,
                                                      block_size, kInt8MinBlockSize,
                                                      kInt8MaxBlockSize));
  }
  return absl::OkStatus();
}

void WriteInt8Header(uint8_t* out, size_t n, size_t block_size) {
  std::memcpy(out, kInt8Magic, 4);
  const uint32_t b = static_cast<uint32_t>(block_size);
  const uint64_t count = n;
  std::memcpy(out + 4, &b, sizeof(b));
  std::memcpy(out + 8, &count, sizeof(count));
}

// Inspects and additionally requires the header's n to equal the destination's n.
absl::StatusOr<Int8EncodedInfo> CheckInt8Buffer(const char* what, const void* in, size_t in_bytes,
                                                size_t n) {
  absl::StatusOr<Int8EncodedInfo> info = Int8BlockwiseInspect(in, in_bytes);
  if (!info.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %s", what, info.status().message()));
  }
  if (info->n != n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: buffer holds %d values but the destination has %d", what, info->n, n));
  }
  return info;
}

// Per-block scale and quantisation multiplier (see the header's encode definition).
struct BlockScale {
  float scale;
  float inv;          // 1 / scale when scale is normal, else unused
  bool use_division;  // scale is subnormal: q = rint(x / scale)
};

// m / 127 rounded to nearest, except: rounded up when subnormal (a subnormal keeps few bits, and
// rounding down could push |x| / scale past 127), and one step down in the single case where
// 127 * scale would overflow (m = FLT_MAX). The products in double are exact.
inline float EncoderScale(float max_abs) {
  float scale = max_abs / 127.0f;
  if (scale < kSmallestNormal) {
    if (static_cast<double>(scale) * 127.0 < static_cast<double>(max_abs)) {
      scale = std::nextafter(scale, kFloatMax);
    }
  } else if (!ScaleInRange(scale)) {
    scale = std::nextafter(scale, 0.0f);
  }
  return scale;
}

inline BlockScale ComputeBlockScale(float max_abs) {
  if (max_abs == 0.0f) return {0.0f, 0.0f, false};
  const float scale = EncoderScale(max_abs);
  if (scale < kSmallestNormal) return {scale, 0.0f, true};
  return {scale, 1.0f / scale, false};
}

// The decoded level of a wire byte: -128 (never written by the encoder) reads as -127, so a
// decode of a buffer with valid scales is always finite.
inline int32_t Level(int8_t q) { return q < -127 ? -127 : q; }

inline float QuantizeToLevel(float t) {
  return std::min(std::max(std::nearbyint(t), -127.0f), 127.0f);
}

// ---- fused loops ----------------------------------------------------------------------------

template <bool kResidual>
absl::Status Bf16EncodeImpl(const float* x, size_t n, uint8_t* out, float* residual) {
  for (size_t begin = 0; begin < n; begin += kBf16Tile) {
    const size_t end = std::min(n, begin + kBf16Tile);
    uint32_t non_finite = 0;
#pragma omp simd reduction(| : non_finite)
    for (size_t i = begin; i < end; ++i) {
      const float v = x[i];
      const uint32_t bits = FloatBits(v);
      non_finite |= static_cast<uint32_t>((bits & kExponentMask) == kExponentMask);
      const uint32_t b = Bf16FromFloatBits(bits);
      StoreU16(out + 2 * i, static_cast<uint16_t>(b));
      if (kResidual) residual[i] = v - BitsToFloat(b << 16);
    }
    if (non_finite != 0) return NonFiniteInputError("Bf16Encode", x, begin, end);
  }
  return absl::OkStatus();
}

// max over the block of the sign-cleared float bits. For non-negative floats the integer order is
// the float order, and NaN/Inf compare above every finite value (>= kExponentMask), so this one
// reduction yields both max |x| and whether the block is finite.
inline uint32_t MaxAbsBits(const float* x, size_t len) {
  size_t i = 0;
  uint32_t max_bits = 0;
#if defined(__SSE4_1__)
  const __m128i abs_mask = _mm_set1_epi32(static_cast<int>(kAbsMask));
  __m128i m0 = _mm_setzero_si128();
  __m128i m1 = m0;
  __m128i m2 = m0;
  __m128i m3 = m0;
  for (; i + 16 <= len; i += 16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(x + i);
    m0 = _mm_max_epu32(m0, _mm_and_si128(_mm_loadu_si128(p), abs_mask));
    m1 = _mm_max_epu32(m1, _mm_and_si128(_mm_loadu_si128(p + 1), abs_mask));
    m2 = _mm_max_epu32(m2, _mm_and_si128(_mm_loadu_si128(p + 2), abs_mask));
    m3 = _mm_max_epu32(m3, _mm_and_si128(_mm_loadu_si128(p + 3), abs_mask));
  }
  __m128i m = _mm_max_epu32(_mm_max_epu32(m0, m1), _mm_max_epu32(m2, m3));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  max_bits = static_cast<uint32_t>(_mm_cvtsi128_si32(m));
#endif
  for (; i < len; ++i) {
    const uint32_t a = FloatBits(x[i]) & kAbsMask;
    max_bits = a > max_bits ? a : max_bits;
  }
  return max_bits;
}

// Quantises one block with its scale already known: q = clamp(rint(x * inv), -127, 127) and
// optionally residual = x - q * scale, with exactly the float operations of the reference.
template <bool kResidual>
void QuantizeBlock(const float* x, size_t len, const BlockScale& bs, int8_t* q, float* residual) {
  if (bs.use_division) {  // rare: max |x| < 127 * 2^-126
    for (size_t i = 0; i < len; ++i) {
      const int32_t level = static_cast<int32_t>(QuantizeToLevel(x[i] / bs.scale));
      q[i] = static_cast<int8_t>(level);
      if (kResidual) residual[i] = x[i] - static_cast<float>(level) * bs.scale;
    }
    return;
  }
  const float inv = bs.inv;
  const float scale = bs.scale;
  size_t i = 0;
#if defined(__SSE4_1__)
  // 16 values per step: multiply, convert to int32 rounding to nearest even (cvtps2dq in the
  // default MXCSR mode, the mode nearbyint uses too), pack 4x4 int32 into 16 int8 with signed
  // saturation. No float clamp is needed on this path: with inv = 1 / scale and |x| <= m,
  // |x * inv| <= 127 + 8e-6 (checked for every float m), so the level never leaves [-127, 127];
  // the pmaxsb below only makes "never -128" hold by construction.
  const __m128 vinv = _mm_set1_ps(inv);
  const __m128 vscale = _mm_set1_ps(scale);
  const __m128i lowest = _mm_set1_epi8(-127);
  for (; i + 16 <= len; i += 16) {
    __m128i words[4];
    for (size_t k = 0; k < 4; ++k) {
      const __m128 v = _mm_loadu_ps(x + i + 4 * k);
      words[k] = _mm_cvtps_epi32(_mm_mul_ps(v, vinv));
      if (kResidual) {
        // From the integer level, as the decoder sees it (a -0.0 level decodes as +0).
        const __m128 decoded = _mm_mul_ps(_mm_cvtepi32_ps(words[k]), vscale);
        _mm_storeu_ps(residual + i + 4 * k, _mm_sub_ps(v, decoded));
      }
    }
    const __m128i bytes = _mm_max_epi8(
        _mm_packs_epi16(_mm_packs_epi32(words[0], words[1]), _mm_packs_epi32(words[2], words[3])),
        lowest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), bytes);
  }
#endif
  for (; i < len; ++i) {
    const float v = x[i];
    const int32_t level = static_cast<int32_t>(QuantizeToLevel(v * inv));
    q[i] = static_cast<int8_t>(level);
    if (kResidual) residual[i] = v - static_cast<float>(level) * scale;
  }
}

template <bool kResidual>
absl::Status Int8EncodeImpl(const float* x, size_t n, size_t block_size, uint8_t* out,
                            float* residual) {
  const size_t blocks = Int8BlockCount(n, block_size);
  uint8_t* scales = out + kInt8HeaderBytes;
  int8_t* q = reinterpret_cast<int8_t*>(scales + 4 * blocks);
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * block_size;
    const size_t len = std::min(block_size, n - begin);
    const float* xb = x + begin;
    const uint32_t max_bits = MaxAbsBits(xb, len);
    if (max_bits >= kExponentMask) {
      return NonFiniteInputError("Int8BlockwiseEncode", x, begin, begin + len);
    }
    const BlockScale bs = ComputeBlockScale(BitsToFloat(max_bits));
    StoreF32(scales + 4 * k, bs.scale);
    QuantizeBlock<kResidual>(xb, len, bs, q + begin, kResidual ? residual + begin : nullptr);
  }
  return absl::OkStatus();
}

// kAccumulate: dst[i] += w * (level(q[i]) * scale), else dst[i] = level(q[i]) * scale. Note
// w * (q * scale), not (w * scale) * q: the same rounding as Decode followed by
// WeightedAccumulate.
template <bool kAccumulate>
void DequantizeBlock(const int8_t* q, size_t len, float scale, float w, float* dst) {
  size_t i = 0;
#if defined(__SSE4_1__)
  // 16 values per step: clamp -128 to -127 (pmaxsb), sign-extend 4x4 bytes to int32 (pmovsxbd),
  // convert and multiply.
  const __m128i lowest = _mm_set1_epi8(-127);
  const __m128 vscale = _mm_set1_ps(scale);
  const __m128 vw = _mm_set1_ps(w);
  for (; i + 16 <= len; i += 16) {
    __m128i bytes = _mm_max_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)), lowest);
    for (size_t k = 0; k < 4; ++k) {
      const __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(bytes)), vscale);
      float* d = dst + i + 4 * k;
      if (kAccumulate) {
        _mm_storeu_ps(d, _mm_add_ps(_mm_loadu_ps(d), _mm_mul_ps(vw, v)));
      } else {
        _mm_storeu_ps(d, v);
      }
      bytes = _mm_srli_si128(bytes, 4);
    }
  }
#endif
  for (; i < len; ++i) {
    const float v = static_cast<float>(Level(q[i])) * scale;
    if (kAccumulate) {
      dst[i] += w * v;
    } else {
      dst[i] = v;
    }
  }
}

}  // namespace

// ---- bf16 -----------------------------------------------------------------------------------

absl::Status Bf16Encode(const float* x, size_t n, void* out, float* residual) {
  uint8_t* o = static_cast<uint8_t*>(out);
  return residual != nullptr ? Bf16EncodeImpl<true>(x, n, o, residual)
                             : Bf16EncodeImpl<false>(x, n, o, nullptr);
}

absl::Status Bf16Decode(const void* in, size_t in_bytes, float* out, size_t n) {
  if (in_bytes != Bf16EncodedSize(n)) return Bf16SizeError("Bf16Decode", in_bytes, n);
  const uint8_t* p = static_cast<const uint8_t*>(in);
  for (size_t begin = 0; begin < n; begin += kBf16Tile) {
    const size_t end = std::min(n, begin + kBf16Tile);
    uint32_t non_finite = 0;
#pragma omp simd reduction(| : non_finite)
    for (size_t i = begin; i < end; ++i) {
      const uint32_t bits = LoadU16(p + 2 * i);
      non_finite |= static_cast<uint32_t>((bits & kBf16ExponentMask) == kBf16ExponentMask);
      out[i] = BitsToFloat(bits << 16);
    }
    if (non_finite != 0) return Bf16NonFiniteError("Bf16Decode", p, begin, end);
  }
  return absl::OkStatus();
}

absl::Status Bf16DecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc, size_t n) {
  if (in_bytes != Bf16EncodedSize(n)) return Bf16SizeError("Bf16DecodeAccumulate", in_bytes, n);
  const uint8_t* p = static_cast<const uint8_t*>(in);
  // Validate everything before touching acc (a second read of the 2-byte values, ~20% of the
  // traffic of the accumulate itself).
  uint32_t non_finite = 0;
#pragma omp simd reduction(| : non_finite)
  for (size_t i = 0; i < n; ++i) non_finite |= Bf16NonFiniteBit(p, i);
  if (non_finite != 0) return Bf16NonFiniteError("Bf16DecodeAccumulate", p, 0, n);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float v = BitsToFloat(static_cast<uint32_t>(LoadU16(p + 2 * i)) << 16);
    acc[i] += w * v;
  }
  return absl::OkStatus();
}

// ---- int8 blockwise -------------------------------------------------------------------------

absl::StatusOr<Int8EncodedInfo> Int8BlockwiseInspect(const void* in, size_t in_bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(in);
  if (in_bytes < kInt8HeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "int8 buffer of %d bytes is shorter than its %d-byte header", in_bytes, kInt8HeaderBytes));
  }
  if (std::memcmp(p, kInt8Magic, sizeof(kInt8Magic)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "int8 buffer has bad magic/version %02x %02x %02x %02x (expected 41 51 38 01)", p[0], p[1],
        p[2], p[3]));
  }
  uint32_t block_size;
  uint64_t n;
  std::memcpy(&block_size, p + 4, sizeof(block_size));
  std::memcpy(&n, p + 8, sizeof(n));
  if (block_size < kInt8MinBlockSize || block_size > kInt8MaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("int8 buffer has block size %d outside [%d, %d]", block_size,
                        kInt8MinBlockSize, kInt8MaxBlockSize));
  }
  // Compare without overflow: a corrupt n near 2^64 must not wrap Int8EncodedSize around.
  if (n > in_bytes || Int8EncodedSize(n, block_size) != in_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "int8 buffer is %d bytes but its header (n=%d, block size %d) implies %s", in_bytes, n,
        block_size,
        n > in_bytes ? "more bytes" : absl::StrFormat("%d bytes", Int8EncodedSize(n, block_size))));
  }
  const size_t blocks = Int8BlockCount(n, block_size);
  const uint8_t* scales = p + kInt8HeaderBytes;
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (size_t k = 0; k < blocks; ++k) bad |= static_cast<uint32_t>(!ScaleValid(scales, k));
  if (bad != 0) {
    for (size_t k = 0; k < blocks; ++k) {
      if (!ScaleValid(scales, k)) {
        const float s = LoadF32(scales + 4 * k);
        return absl::InvalidArgumentError(absl::StrFormat(
            "int8 buffer has invalid scale %g (bits 0x%08x) for block %d; scales must be "
            "finite, >= 0 and at most FLT_MAX / 127",
            s, FloatBits(s), k));
      }
    }
  }
  return Int8EncodedInfo{static_cast<size_t>(n), block_size};
}

absl::Status Int8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual) {
  if (absl::Status s = CheckBlockSize("Int8BlockwiseEncode", block_size); !s.ok()) return s;
  uint8_t* o = static_cast<uint8_t*>(out);
  WriteInt8Header(o, n, block_size);
  return residual != nullptr ? Int8EncodeImpl<true>(x, n, block_size, o, residual)
                             : Int8EncodeImpl<false>(x, n, block_size, o, nullptr);
}

absl::Status Int8BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n) {
  absl::StatusOr<Int8EncodedInfo> info = CheckInt8Buffer("Int8BlockwiseDecode", in, in_bytes, n);
  if (!info.ok()) return info.status();
  const size_t block_size = info->block_size;
  const size_t blocks = Int8BlockCount(n, block_size);
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt8HeaderBytes;
  const int8_t* q = reinterpret_cast<const int8_t*>(scales + 4 * blocks);
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * block_size;
    const size_t len = std::min(block_size, n - begin);
    const float scale = LoadF32(scales + 4 * k);
    DequantizeBlock<false>(q + begin, len, scale, 0.0f, out + begin);
  }
  return absl::OkStatus();
}

absl::Status Int8BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n) {
  absl::StatusOr<Int8EncodedInfo> info =
      CheckInt8Buffer("Int8BlockwiseDecodeAccumulate", in, in_bytes, n);
  if (!info.ok()) return info.status();
  const size_t block_size = info->block_size;
  const size_t blocks = Int8BlockCount(n, block_size);
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt8HeaderBytes;
  const int8_t* q = reinterpret_cast<const int8_t*>(scales + 4 * blocks);
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * block_size;
    const size_t len = std::min(block_size, n - begin);
    const float scale = LoadF32(scales + 4 * k);
    DequantizeBlock<true>(q + begin, len, scale, w, acc + begin);
  }
  return absl::OkStatus();
}

// ---- scalar references ----------------------------------------------------------------------

namespace reference {

absl::Status Bf16Encode(const float* x, size_t n, void* out, float* residual) {
  uint8_t* o = static_cast<uint8_t*>(out);
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Bf16Encode: x[%d] is %s; only finite values can be encoded", i, NonFiniteName(v)));
    }
    const uint32_t bits = FloatBits(v);
    const uint32_t lsb = (bits >> 16) & 1u;
    uint32_t b = (bits + 0x7fffu + lsb) >> 16;
    if ((b & 0x7f80u) == 0x7f80u) b = (b & 0x8000u) | 0x7f7fu;  // saturate finite overflow
    StoreU16(o + 2 * i, static_cast<uint16_t>(b));
    if (residual != nullptr) residual[i] = v - BitsToFloat(b << 16);
  }
  return absl::OkStatus();
}

absl::Status Bf16Decode(const void* in, size_t in_bytes, float* out, size_t n) {
  if (in_bytes != Bf16EncodedSize(n)) return Bf16SizeError("Bf16Decode", in_bytes, n);
  const uint8_t* p = static_cast<const uint8_t*>(in);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = LoadU16(p + 2 * i);
    const float v = BitsToFloat(bits << 16);
    if (!std::isfinite(v)) return Bf16NonFiniteError("Bf16Decode", p, i, i + 1);
    out[i] = v;
  }
  return absl::OkStatus();
}

absl::Status Bf16DecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc, size_t n) {
  if (in_bytes != Bf16EncodedSize(n)) return Bf16SizeError("Bf16DecodeAccumulate", in_bytes, n);
  const uint8_t* p = static_cast<const uint8_t*>(in);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(BitsToFloat(static_cast<uint32_t>(LoadU16(p + 2 * i)) << 16))) {
      return Bf16NonFiniteError("Bf16DecodeAccumulate", p, i, i + 1);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const float v = BitsToFloat(static_cast<uint32_t>(LoadU16(p + 2 * i)) << 16);
    acc[i] += w * v;
  }
  return absl::OkStatus();
}

absl::Status Int8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual) {
  if (absl::Status s = CheckBlockSize("Int8BlockwiseEncode", block_size); !s.ok()) return s;
  uint8_t* o = static_cast<uint8_t*>(out);
  WriteInt8Header(o, n, block_size);
  const size_t blocks = Int8BlockCount(n, block_size);
  uint8_t* scales = o + kInt8HeaderBytes;
  int8_t* q = reinterpret_cast<int8_t*>(scales + 4 * blocks);
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * block_size;
    const size_t end = std::min(n, begin + block_size);
    float max_abs = 0.0f;
    for (size_t i = begin; i < end; ++i) {
      if (!std::isfinite(x[i])) {
        return absl::InvalidArgumentError(
            absl::StrFormat("Int8BlockwiseEncode: x[%d] is %s; only finite values can be encoded",
                            i, NonFiniteName(x[i])));
      }
      max_abs = std::max(max_abs, std::fabs(x[i]));
    }
    float scale = max_abs / 127.0f;
    if (scale < kSmallestNormal) {
      if (static_cast<double>(scale) * 127.0 < static_cast<double>(max_abs)) {
        scale = std::nextafter(scale, kFloatMax);  // subnormal: round up
      }
    } else if (!(scale * 127.0f <= kFloatMax)) {
      scale = std::nextafter(scale, 0.0f);  // only m = FLT_MAX
    }
    StoreF32(scales + 4 * k, scale);
    for (size_t i = begin; i < end; ++i) {
      float level = 0.0f;
      if (scale >= kSmallestNormal) {
        level = std::nearbyint(x[i] * (1.0f / scale));
      } else if (scale > 0.0f) {
        level = std::nearbyint(x[i] / scale);
      }
      level = std::min(std::max(level, -127.0f), 127.0f);
      q[i] = static_cast<int8_t>(level);
      if (residual != nullptr) residual[i] = x[i] - static_cast<float>(q[i]) * scale;
    }
  }
  return absl::OkStatus();
}

absl::Status Int8BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n) {
  absl::StatusOr<Int8EncodedInfo> info = CheckInt8Buffer("Int8BlockwiseDecode", in, in_bytes, n);
  if (!info.ok()) return info.status();
  const size_t blocks = Int8BlockCount(n, info->block_size);
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt8HeaderBytes;
  const int8_t* q = reinterpret_cast<const int8_t*>(scales + 4 * blocks);
  for (size_t i = 0; i < n; ++i) {
    const int level = q[i] == -128 ? -127 : q[i];
    out[i] = static_cast<float>(level) * LoadF32(scales + 4 * (i / info->block_size));
  }
  return absl::OkStatus();
}

absl::Status Int8BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n) {
  absl::StatusOr<Int8EncodedInfo> info =
      CheckInt8Buffer("Int8BlockwiseDecodeAccumulate", in, in_bytes, n);
  if (!info.ok()) return info.status();
  const size_t blocks = Int8BlockCount(n, info->block_size);
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt8HeaderBytes;
  const int8_t* q = reinterpret_cast<const int8_t*>(scales + 4 * blocks);
  for (size_t i = 0; i < n; ++i) {
    const int level = q[i] == -128 ? -127 : q[i];
    const float v = static_cast<float>(level) * LoadF32(scales + 4 * (i / info->block_size));
    acc[i] += w * v;
  }
  return absl::OkStatus();
}

}  // namespace reference
}  // namespace aloe::kernels
