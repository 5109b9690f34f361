#include "kernels/cpu/codec_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_format.h"

#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif

// Built with -O3 -march=x86-64-v2 and OpenMP (kernels/CMakeLists.txt), so SSE4.1 (and SSSE3) is
// the baseline; AVX2 is not assumed. The int8 and int4 loops use SSE4.1 intrinsics (GCC's own
// vectorisation of the float -> int8 conversion and of the -128 clamp was 2-5x slower; int4
// adds nibble packing, and a pshufb table lookup to unpack); the bf16 loops are plain `omp simd`
// loops that GCC vectorises. Every SIMD loop has a scalar tail doing the same float operations,
// which is also the whole loop on a build without SSE4.1. Byte buffers are accessed through memcpy
// or unaligned loads (no alignment or aliasing assumptions). The int8 encoder makes two passes per
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

// The largest level of each blockwise codec: int8 quantises to [-127, 127], int4 to [-7, 7].
constexpr float kInt8MaxLevel = 127.0f;
constexpr float kInt4MaxLevel = 7.0f;

// Scales are valid when max_level * scale is finite (false for NaN and Inf too). Only a block
// whose max is near FLT_MAX rounds m / max_level above that; the encoder steps it down by one
// float.
inline bool ScaleInRange(float scale, float max_level) { return scale * max_level <= kFloatMax; }

// A wire scale is valid when its sign bit is clear (the encoder never writes -0 either) and
// max_level * scale is finite (false for NaN and Inf too).
inline bool ScaleValid(const uint8_t* scales, size_t k, float max_level) {
  const float s = LoadF32(scales + 4 * k);
  return (FloatBits(s) >> 31) == 0 && ScaleInRange(s, max_level);
}

// The error for a wire scale that ScaleValid refuses; `codec` names the format.
absl::Status InvalidScaleError(const char* codec, const uint8_t* scales, size_t k,
                               const char* bound) {
  const float s = LoadF32(scales + 4 * k);
  return absl::InvalidArgumentError(
      absl::StrFormat("%s buffer has invalid scale %g (bits 0x%08x) for block %d; scales must be "
                      "finite, >= 0 and at most %s",
                      codec, s, FloatBits(s), k, bound));
}

// The first invalid scale of `blocks` as an error, or OK. Scans branch-free first: the common
// case is a valid buffer.
absl::Status CheckScales(const char* codec, const uint8_t* scales, size_t blocks, float max_level,
                         const char* bound) {
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (size_t k = 0; k < blocks; ++k) {
    bad |= static_cast<uint32_t>(!ScaleValid(scales, k, max_level));
  }
  if (bad == 0) return absl::OkStatus();
  for (size_t k = 0; k < blocks; ++k) {
    if (!ScaleValid(scales, k, max_level)) return InvalidScaleError(codec, scales, k, bound);
  }
  return absl::InternalError(absl::StrFormat("%s: invalid scale not found again", codec));
}

// The first checks of an int8 or int4 buffer: long enough for its header, with the right magic
// and version. `codec` names the format in the error.
absl::Status CheckHeaderAndMagic(const char* codec, const uint8_t* p, size_t in_bytes,
                                 const unsigned char (&magic)[4]) {
  static_assert(kInt8HeaderBytes == kInt4HeaderBytes);
  if (in_bytes < kInt8HeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s buffer of %d bytes is shorter than its %d-byte header", codec, in_bytes,
                        kInt8HeaderBytes));
  }
  if (std::memcmp(p, magic, 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s buffer has bad magic/version %02x %02x %02x %02x (expected %02x %02x "
                        "%02x %02x)",
                        codec, p[0], p[1], p[2], p[3], magic[0], magic[1], magic[2], magic[3]));
  }
  return absl::OkStatus();
}

// A buffer whose length disagrees with its header; `implied` is 0 when the header's n alone
// needs more bytes than the buffer has.
absl::Status SizeMismatchError(const char* codec, size_t in_bytes, uint64_t n, size_t block_size,
                               size_t implied) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s buffer is %d bytes but its header (n=%d, block size %d) implies %s", codec, in_bytes, n,
      block_size, implied == 0 ? "more bytes" : absl::StrFormat("%d bytes", implied)));
}

// What an int8/int4 header says, read without validation.
struct RawHeader {
  uint32_t block_size;
  uint64_t n;
};

inline RawHeader ReadHeader(const uint8_t* p) {
  RawHeader h;
  std::memcpy(&h.block_size, p + 4, sizeof(h.block_size));
  std::memcpy(&h.n, p + 8, sizeof(h.n));
  return h;
}

void WriteHeader(const unsigned char (&magic)[4], uint8_t* out, size_t n, size_t block_size) {
  std::memcpy(out, magic, 4);
  const uint32_t b = static_cast<uint32_t>(block_size);
  const uint64_t count = n;
  std::memcpy(out + 4, &b, sizeof(b));
  std::memcpy(out + 8, &count, sizeof(count));
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
  WriteHeader(kInt8Magic, out, n, block_size);
}

using InspectFn = absl::StatusOr<BlockwiseEncodedInfo> (*)(const void* in, size_t in_bytes);

// Inspects with `inspect` and additionally requires the header's n to equal the destination's
// n; `what` names the caller in the error.
absl::StatusOr<BlockwiseEncodedInfo> CheckBlockwiseBuffer(const char* what, InspectFn inspect,
                                                          const void* in, size_t in_bytes,
                                                          size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info = inspect(in, in_bytes);
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

// m / max_level rounded to nearest, except: rounded up when subnormal (a subnormal keeps few
// bits, and rounding down could push |x| / scale past max_level), and one step down where
// max_level * scale would overflow (m near FLT_MAX). The products in double are exact.
inline float EncoderScale(float max_abs, float max_level) {
  float scale = max_abs / max_level;
  if (scale < kSmallestNormal) {
    if (static_cast<double>(scale) * static_cast<double>(max_level) <
        static_cast<double>(max_abs)) {
      scale = std::nextafter(scale, kFloatMax);
    }
  } else if (!ScaleInRange(scale, max_level)) {
    scale = std::nextafter(scale, 0.0f);
  }
  return scale;
}

inline BlockScale ComputeBlockScale(float max_abs, float max_level) {
  if (max_abs == 0.0f) return {0.0f, 0.0f, false};
  const float scale = EncoderScale(max_abs, max_level);
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

#if defined(__SSE4_1__)
// 16 int8 levels to 16 floats: sign-extend 4 bytes at a time to int32 (pmovsxbd), convert and
// multiply by the scale; then dst[i] = v, or dst[i] += w * v when kAccumulate.
template <bool kAccumulate>
inline void StoreLevels(__m128i bytes, __m128 vscale, __m128 vw, float* dst) {
  for (size_t k = 0; k < 4; ++k) {
    const __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(bytes)), vscale);
    float* d = dst + 4 * k;
    if (kAccumulate) {
      _mm_storeu_ps(d, _mm_add_ps(_mm_loadu_ps(d), _mm_mul_ps(vw, v)));
    } else {
      _mm_storeu_ps(d, v);
    }
    bytes = _mm_srli_si128(bytes, 4);
  }
}
#endif

// kAccumulate: dst[i] += w * (level(q[i]) * scale), else dst[i] = level(q[i]) * scale. Note
// w * (q * scale), not (w * scale) * q: the same rounding as Decode followed by
// WeightedAccumulate.
template <bool kAccumulate>
void DequantizeBlock(const int8_t* q, size_t len, float scale, float w, float* dst) {
  size_t i = 0;
#if defined(__SSE4_1__)
  // 16 values per step: clamp -128 to -127 (pmaxsb), then StoreLevels.
  const __m128i lowest = _mm_set1_epi8(-127);
  const __m128 vscale = _mm_set1_ps(scale);
  const __m128 vw = _mm_set1_ps(w);
  for (; i + 16 <= len; i += 16) {
    const __m128i bytes =
        _mm_max_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)), lowest);
    StoreLevels<kAccumulate>(bytes, vscale, vw, dst + i);
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

// ---- int4 helpers ---------------------------------------------------------------------------

absl::Status CheckInt4BlockSize(const char* what, size_t block_size) {
  if (!Int4BlockSizeValid(block_size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: block size %d is not an even number in [%d, %d]", what, block_size,
                        kInt4MinBlockSize, kInt4MaxBlockSize));
  }
  return absl::OkStatus();
}

inline float QuantizeToInt4Level(float t) {
  return std::min(std::max(std::nearbyint(t), -kInt4MaxLevel), kInt4MaxLevel);
}

// The level of value x in a block with scale bs, as the header defines it.
inline int32_t Int4LevelOf(float x, const BlockScale& bs) {
  return static_cast<int32_t>(QuantizeToInt4Level(bs.use_division ? x / bs.scale : x * bs.inv));
}

// The decoded level of a nibble (its low 4 bits): two's complement, -8 read as -7.
inline int32_t Int4Level(uint32_t nibble) {
  const int32_t q = static_cast<int32_t>(nibble & 0xfu) - ((nibble & 0x8u) != 0 ? 16 : 0);
  return q < -7 ? -7 : q;
}

#if defined(__SSE4_1__)
// 16 int8 levels in [-7, 7] (values 2j and 2j + 1 in bytes 2j, 2j + 1) to 8 packed bytes, one in
// the low byte of each 16-bit lane: value 2j in the low nibble, value 2j + 1 in the high one.
inline __m128i PairNibbles(__m128i levels) {
  const __m128i t = _mm_and_si128(levels, _mm_set1_epi8(0x0f));
  return _mm_or_si128(_mm_and_si128(t, _mm_set1_epi16(0x000f)),
                      _mm_and_si128(_mm_srli_epi16(t, 4), _mm_set1_epi16(0x00f0)));
}
#endif

// Quantises one int4 block of len values that starts at an even index, with its scale already
// known, into q[0, ceil(len / 2)); an odd len leaves the last high nibble 0. Optionally writes
// residual = x - q * scale, with exactly the float operations of the reference.
template <bool kResidual>
void QuantizeBlock4(const float* x, size_t len, const BlockScale& bs, uint8_t* q, float* residual) {
  size_t i = 0;
#if defined(__SSE4_1__)
  if (!bs.use_division) {
    // 32 values per step: multiply, convert to int32 rounding to nearest even (as nearbyint),
    // clamp to [-7, 7] (as the reference's float clamp after rounding), pack to 32 int8 levels
    // and pair them into 16 bytes.
    const __m128 vinv = _mm_set1_ps(bs.inv);
    const __m128 vscale = _mm_set1_ps(bs.scale);
    const __m128i lowest = _mm_set1_epi32(-7);
    const __m128i highest = _mm_set1_epi32(7);
    for (; i + 32 <= len; i += 32) {
      __m128i words[8];
      for (size_t k = 0; k < 8; ++k) {
        const __m128 v = _mm_loadu_ps(x + i + 4 * k);
        words[k] =
            _mm_min_epi32(_mm_max_epi32(_mm_cvtps_epi32(_mm_mul_ps(v, vinv)), lowest), highest);
        if (kResidual) {
          const __m128 decoded = _mm_mul_ps(_mm_cvtepi32_ps(words[k]), vscale);
          _mm_storeu_ps(residual + i + 4 * k, _mm_sub_ps(v, decoded));
        }
      }
      const __m128i low =
          _mm_packs_epi16(_mm_packs_epi32(words[0], words[1]), _mm_packs_epi32(words[2], words[3]));
      const __m128i high =
          _mm_packs_epi16(_mm_packs_epi32(words[4], words[5]), _mm_packs_epi32(words[6], words[7]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i / 2),
                       _mm_packus_epi16(PairNibbles(low), PairNibbles(high)));
    }
  }
#endif
  for (; i < len; i += 2) {
    const int32_t first = Int4LevelOf(x[i], bs);
    const int32_t second = i + 1 < len ? Int4LevelOf(x[i + 1], bs) : 0;
    q[i / 2] = static_cast<uint8_t>((first & 0xf) | ((second & 0xf) << 4));
    if (kResidual) {
      residual[i] = x[i] - static_cast<float>(first) * bs.scale;
      if (i + 1 < len) residual[i + 1] = x[i + 1] - static_cast<float>(second) * bs.scale;
    }
  }
}

// Encodes x[0, n) into the scales and levels of `out` (header written by the caller) as int8,
// or as int4 when kInt4: one block at a time, max first, then quantise while it is in L1.
template <bool kResidual, bool kInt4>
absl::Status EncodeBlocks(const float* x, size_t n, size_t block_size, uint8_t* out,
                          float* residual) {
  static_assert(kInt8HeaderBytes == kInt4HeaderBytes);
  const size_t blocks = Int8BlockCount(n, block_size);
  uint8_t* scales = out + kInt8HeaderBytes;
  uint8_t* q = scales + 4 * blocks;
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * block_size;
    const size_t len = std::min(block_size, n - begin);
    const float* xb = x + begin;
    const uint32_t max_bits = MaxAbsBits(xb, len);
    if (max_bits >= kExponentMask) {
      return NonFiniteInputError(kInt4 ? "Int4BlockwiseEncode" : "Int8BlockwiseEncode", x, begin,
                                 begin + len);
    }
    const BlockScale bs =
        ComputeBlockScale(BitsToFloat(max_bits), kInt4 ? kInt4MaxLevel : kInt8MaxLevel);
    StoreF32(scales + 4 * k, bs.scale);
    float* rb = kResidual ? residual + begin : nullptr;
    if (kInt4) {
      QuantizeBlock4<kResidual>(xb, len, bs, q + begin / 2, rb);
    } else {
      QuantizeBlock<kResidual>(xb, len, bs, reinterpret_cast<int8_t*>(q) + begin, rb);
    }
  }
  return absl::OkStatus();
}

// Decodes one int4 block of len values that starts at an even index, from q[0, ceil(len / 2)).
// kAccumulate: dst[i] += w * (level * scale), else dst[i] = level * scale (as int8).
template <bool kAccumulate>
void DequantizeBlock4(const uint8_t* q, size_t len, float scale, float w, float* dst) {
  size_t i = 0;
#if defined(__SSE4_1__)
  // 32 values per step: split 16 bytes into low and high nibbles, map each nibble to its level
  // with one pshufb (the -8 pattern maps to -7), interleave them back into value order, then
  // StoreLevels.
  const __m128i levels = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -7, -7, -6, -5, -4, -3, -2, -1);
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128 vscale = _mm_set1_ps(scale);
  const __m128 vw = _mm_set1_ps(w);
  for (; i + 32 <= len; i += 32) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i / 2));
    const __m128i low = _mm_shuffle_epi8(levels, _mm_and_si128(packed, nibble));
    const __m128i high = _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    StoreLevels<kAccumulate>(_mm_unpacklo_epi8(low, high), vscale, vw, dst + i);
    StoreLevels<kAccumulate>(_mm_unpackhi_epi8(low, high), vscale, vw, dst + i + 16);
  }
#endif
  for (; i < len; ++i) {
    const uint32_t byte = q[i / 2];
    const float v = static_cast<float>(Int4Level(i % 2 == 0 ? byte : byte >> 4)) * scale;
    if (kAccumulate) {
      dst[i] += w * v;
    } else {
      dst[i] = v;
    }
  }
}

// Decodes (or accumulates) a whole int8 (kInt4 false) or int4 buffer after CheckBlockwiseBuffer
// accepted it, one block at a time.
template <bool kAccumulate, bool kInt4 = false>
void DecodeBlocks(const void* in, const BlockwiseEncodedInfo& info, float w, float* dst) {
  static_assert(kInt8HeaderBytes == kInt4HeaderBytes);
  const size_t blocks = Int8BlockCount(info.n, info.block_size);
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt8HeaderBytes;
  const uint8_t* q = scales + 4 * blocks;
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * info.block_size;
    const size_t len = std::min(info.block_size, info.n - begin);
    const float scale = LoadF32(scales + 4 * k);
    if (kInt4) {
      DequantizeBlock4<kAccumulate>(q + begin / 2, len, scale, w, dst + begin);
    } else {
      DequantizeBlock<kAccumulate>(reinterpret_cast<const int8_t*>(q) + begin, len, scale, w,
                                   dst + begin);
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
  if (absl::Status s = CheckHeaderAndMagic("int8", p, in_bytes, kInt8Magic); !s.ok()) return s;
  const auto [block_size, n] = ReadHeader(p);
  if (block_size < kInt8MinBlockSize || block_size > kInt8MaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("int8 buffer has block size %d outside [%d, %d]", block_size,
                        kInt8MinBlockSize, kInt8MaxBlockSize));
  }
  // Compare without overflow: a corrupt n near 2^64 must not wrap Int8EncodedSize around.
  if (n > in_bytes || Int8EncodedSize(n, block_size) != in_bytes) {
    return SizeMismatchError("int8", in_bytes, n, block_size,
                             n > in_bytes ? 0 : Int8EncodedSize(n, block_size));
  }
  const size_t blocks = Int8BlockCount(n, block_size);
  if (absl::Status s =
          CheckScales("int8", p + kInt8HeaderBytes, blocks, kInt8MaxLevel, "FLT_MAX / 127");
      !s.ok()) {
    return s;
  }
  return Int8EncodedInfo{static_cast<size_t>(n), block_size};
}

absl::Status Int8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual) {
  if (absl::Status s = CheckBlockSize("Int8BlockwiseEncode", block_size); !s.ok()) return s;
  uint8_t* o = static_cast<uint8_t*>(out);
  WriteInt8Header(o, n, block_size);
  return residual != nullptr ? EncodeBlocks<true, false>(x, n, block_size, o, residual)
                             : EncodeBlocks<false, false>(x, n, block_size, o, nullptr);
}

absl::Status Int8BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info =
      CheckBlockwiseBuffer("Int8BlockwiseDecode", Int8BlockwiseInspect, in, in_bytes, n);
  if (!info.ok()) return info.status();
  DecodeBlocks<false>(in, *info, 0.0f, out);
  return absl::OkStatus();
}

absl::Status Int8BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info =
      CheckBlockwiseBuffer("Int8BlockwiseDecodeAccumulate", Int8BlockwiseInspect, in, in_bytes, n);
  if (!info.ok()) return info.status();
  DecodeBlocks<true>(in, *info, w, acc);
  return absl::OkStatus();
}

// ---- int4 blockwise -------------------------------------------------------------------------

absl::StatusOr<Int4EncodedInfo> Int4BlockwiseInspect(const void* in, size_t in_bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(in);
  if (absl::Status s = CheckHeaderAndMagic("int4", p, in_bytes, kInt4Magic); !s.ok()) return s;
  const auto [block_size, n] = ReadHeader(p);
  if (!Int4BlockSizeValid(block_size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("int4 buffer has block size %d, not an even number in [%d, %d]", block_size,
                        kInt4MinBlockSize, kInt4MaxBlockSize));
  }
  // Compare without overflow: a corrupt n near 2^64 must not wrap Int4EncodedSize around.
  if (n / 2 > in_bytes || Int4EncodedSize(n, block_size) != in_bytes) {
    return SizeMismatchError("int4", in_bytes, n, block_size,
                             n / 2 > in_bytes ? 0 : Int4EncodedSize(n, block_size));
  }
  const size_t blocks = Int4BlockCount(n, block_size);
  if (absl::Status s =
          CheckScales("int4", p + kInt4HeaderBytes, blocks, kInt4MaxLevel, "FLT_MAX / 7");
      !s.ok()) {
    return s;
  }
  if (n % 2 == 1 && (p[in_bytes - 1] >> 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("int4 buffer of odd n=%d has padding nibble 0x%x after its last value; "
                        "it must be 0",
                        n, p[in_bytes - 1] >> 4));
  }
  return Int4EncodedInfo{static_cast<size_t>(n), block_size};
}

absl::Status Int4BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual) {
  if (absl::Status s = CheckInt4BlockSize("Int4BlockwiseEncode", block_size); !s.ok()) return s;
  uint8_t* o = static_cast<uint8_t*>(out);
  WriteHeader(kInt4Magic, o, n, block_size);
  return residual != nullptr ? EncodeBlocks<true, true>(x, n, block_size, o, residual)
                             : EncodeBlocks<false, true>(x, n, block_size, o, nullptr);
}

absl::Status Int4BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info =
      CheckBlockwiseBuffer("Int4BlockwiseDecode", Int4BlockwiseInspect, in, in_bytes, n);
  if (!info.ok()) return info.status();
  DecodeBlocks<false, true>(in, *info, 0.0f, out);
  return absl::OkStatus();
}

absl::Status Int4BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info =
      CheckBlockwiseBuffer("Int4BlockwiseDecodeAccumulate", Int4BlockwiseInspect, in, in_bytes, n);
  if (!info.ok()) return info.status();
  DecodeBlocks<true, true>(in, *info, w, acc);
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

namespace {

// The plain definition of blockwise absmax encoding that int8 and int4 share (max_level 127 or
// 7): writes each block's scale to scales[k] and hands each value's level to store(i, level).
template <typename StoreLevel>
absl::Status BlockwiseEncode(const char* what, const float* x, size_t n, size_t block_size,
                             float max_level, uint8_t* scales, float* residual, StoreLevel store) {
  const size_t blocks = (n + block_size - 1) / block_size;
  for (size_t k = 0; k < blocks; ++k) {
    const size_t begin = k * block_size;
    const size_t end = std::min(n, begin + block_size);
    float max_abs = 0.0f;
    for (size_t i = begin; i < end; ++i) {
      if (!std::isfinite(x[i])) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: x[%d] is %s; only finite values can be encoded", what, i, NonFiniteName(x[i])));
      }
      max_abs = std::max(max_abs, std::fabs(x[i]));
    }
    float scale = max_abs / max_level;
    if (scale < kSmallestNormal) {
      if (static_cast<double>(scale) * static_cast<double>(max_level) <
          static_cast<double>(max_abs)) {
        scale = std::nextafter(scale, kFloatMax);  // subnormal: round up
      }
    } else if (!(scale * max_level <= kFloatMax)) {
      scale = std::nextafter(scale, 0.0f);  // m near FLT_MAX
    }
    StoreF32(scales + 4 * k, scale);
    for (size_t i = begin; i < end; ++i) {
      float level = 0.0f;
      if (scale >= kSmallestNormal) {
        level = std::nearbyint(x[i] * (1.0f / scale));
      } else if (scale > 0.0f) {
        level = std::nearbyint(x[i] / scale);
      }
      level = std::min(std::max(level, -max_level), max_level);
      const int q = static_cast<int>(level);
      store(i, q);
      if (residual != nullptr) residual[i] = x[i] - static_cast<float>(q) * scale;
    }
  }
  return absl::OkStatus();
}

// The plain definition of blockwise decoding: value i is level_at(i) * its block's scale;
// written to out[i], or added as acc[i] += w * value when acc is not null.
template <typename LevelAt>
void BlockwiseDecode(const BlockwiseEncodedInfo& info, const uint8_t* scales, LevelAt level_at,
                     float* out, float w, float* acc) {
  for (size_t i = 0; i < info.n; ++i) {
    const float v = static_cast<float>(level_at(i)) * LoadF32(scales + 4 * (i / info.block_size));
    if (acc != nullptr) {
      acc[i] += w * v;
    } else {
      out[i] = v;
    }
  }
}

// The level of int8 byte q: -128 reads as -127.
int Int8LevelAt(const int8_t* q, size_t i) { return q[i] == -128 ? -127 : q[i]; }

// The level of int4 value i: its nibble as two's complement, -8 read as -7.
int Int4LevelAt(const uint8_t* q, size_t i) {
  const int nibble = i % 2 == 0 ? q[i / 2] & 0xf : q[i / 2] >> 4;
  const int level = nibble >= 8 ? nibble - 16 : nibble;
  return level == -8 ? -7 : level;
}

absl::Status Int8Decode(const char* what, const void* in, size_t in_bytes, float* out, float w,
                        float* acc, size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info =
      CheckBlockwiseBuffer(what, Int8BlockwiseInspect, in, in_bytes, n);
  if (!info.ok()) return info.status();
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt8HeaderBytes;
  const int8_t* q =
      reinterpret_cast<const int8_t*>(scales + 4 * Int8BlockCount(n, info->block_size));
  BlockwiseDecode(
      *info, scales, [q](size_t i) { return Int8LevelAt(q, i); }, out, w, acc);
  return absl::OkStatus();
}

absl::Status Int4Decode(const char* what, const void* in, size_t in_bytes, float* out, float w,
                        float* acc, size_t n) {
  absl::StatusOr<BlockwiseEncodedInfo> info =
      CheckBlockwiseBuffer(what, Int4BlockwiseInspect, in, in_bytes, n);
  if (!info.ok()) return info.status();
  const uint8_t* scales = static_cast<const uint8_t*>(in) + kInt4HeaderBytes;
  const uint8_t* q = scales + 4 * Int4BlockCount(n, info->block_size);
  BlockwiseDecode(
      *info, scales, [q](size_t i) { return Int4LevelAt(q, i); }, out, w, acc);
  return absl::OkStatus();
}

}  // namespace

absl::Status Int8BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual) {
  if (absl::Status s = CheckBlockSize("Int8BlockwiseEncode", block_size); !s.ok()) return s;
  uint8_t* o = static_cast<uint8_t*>(out);
  WriteInt8Header(o, n, block_size);
  uint8_t* scales = o + kInt8HeaderBytes;
  int8_t* q = reinterpret_cast<int8_t*>(scales + 4 * Int8BlockCount(n, block_size));
  return BlockwiseEncode("Int8BlockwiseEncode", x, n, block_size, 127.0f, scales, residual,
                         [q](size_t i, int level) { q[i] = static_cast<int8_t>(level); });
}

absl::Status Int8BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n) {
  return Int8Decode("Int8BlockwiseDecode", in, in_bytes, out, 0.0f, nullptr, n);
}

absl::Status Int8BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n) {
  return Int8Decode("Int8BlockwiseDecodeAccumulate", in, in_bytes, nullptr, w, acc, n);
}

absl::Status Int4BlockwiseEncode(const float* x, size_t n, size_t block_size, void* out,
                                 float* residual) {
  if (absl::Status s = CheckInt4BlockSize("Int4BlockwiseEncode", block_size); !s.ok()) return s;
  uint8_t* o = static_cast<uint8_t*>(out);
  WriteHeader(kInt4Magic, o, n, block_size);
  uint8_t* scales = o + kInt4HeaderBytes;
  uint8_t* q = scales + 4 * Int4BlockCount(n, block_size);
  // Value 2j sets byte j, which also zeroes the high nibble: the padding when 2j == n - 1.
  return BlockwiseEncode(
      "Int4BlockwiseEncode", x, n, block_size, 7.0f, scales, residual, [q](size_t i, int level) {
        const uint8_t nibble = static_cast<uint8_t>(level & 0xf);
        q[i / 2] = i % 2 == 0 ? nibble : static_cast<uint8_t>(q[i / 2] | (nibble << 4));
      });
}

absl::Status Int4BlockwiseDecode(const void* in, size_t in_bytes, float* out, size_t n) {
  return Int4Decode("Int4BlockwiseDecode", in, in_bytes, out, 0.0f, nullptr, n);
}

absl::Status Int4BlockwiseDecodeAccumulate(const void* in, size_t in_bytes, float w, float* acc,
                                           size_t n) {
  return Int4Decode("Int4BlockwiseDecodeAccumulate", in, in_bytes, nullptr, w, acc, n);
}

}  // namespace reference
}  // namespace aloe::kernels
