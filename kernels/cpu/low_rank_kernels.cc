#include "kernels/cpu/low_rank_kernels.h"

#include <algorithm>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// Built with -O3 -march=x86-64-v2 (kernels/CMakeLists.txt): SSE is the baseline, there is no FMA
// to contract a multiply and an add into, and no -ffast-math to reorder sums, so the intrinsics,
// the scalar tails and the references all round alike. The vector kernel keeps a tile of up to
// 4 rows x 8 columns in registers for the whole k loop: each Qt load serves 4 rows and the
// partial sums never go to memory. Columns are walked in panels so that the panel of Qt (rank
// rows of kPanel floats) stays in L2 while every row block passes over it.

namespace aloe::kernels {
namespace {

constexpr size_t kPanel = 512;

// One output element: the definition of the rounding (see the header).
inline float Dot(const float* p_row, size_t rank, const float* qt_col, size_t cols) {
  float s = 0.0f;
  for (size_t k = 0; k < rank; ++k) s += p_row[k] * qt_col[k * cols];
  return s;
}

// Rows [0, R) of p, columns [0, len) of qt and out (already offset to column j0). kAccumulate:
// out = base + scale * s, else out = s.
template <int R, bool kAccumulate>
void Tile(const float* p, size_t rank, const float* qt, size_t cols, size_t len, float scale,
          const float* base, float* out) {
  size_t t = 0;
#if defined(__SSE2__)
  const __m128 vscale = _mm_set1_ps(scale);
  for (; t + 8 <= len; t += 8) {
    __m128 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm_setzero_ps();
    const float* q = qt + t;
    for (size_t k = 0; k < rank; ++k, q += cols) {
      const __m128 q0 = _mm_loadu_ps(q);
      const __m128 q1 = _mm_loadu_ps(q + 4);
      for (int r = 0; r < R; ++r) {
        const __m128 pk = _mm_set1_ps(p[r * rank + k]);
        a0[r] = _mm_add_ps(a0[r], _mm_mul_ps(pk, q0));
        a1[r] = _mm_add_ps(a1[r], _mm_mul_ps(pk, q1));
      }
    }
    for (int r = 0; r < R; ++r) {
      float* o = out + r * cols + t;
      if constexpr (kAccumulate) {
        const float* b = base + r * cols + t;
        a0[r] = _mm_add_ps(_mm_loadu_ps(b), _mm_mul_ps(vscale, a0[r]));
        a1[r] = _mm_add_ps(_mm_loadu_ps(b + 4), _mm_mul_ps(vscale, a1[r]));
      }
      _mm_storeu_ps(o, a0[r]);
      _mm_storeu_ps(o + 4, a1[r]);
    }
  }
  for (; t + 4 <= len; t += 4) {
    __m128 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm_setzero_ps();
    const float* q = qt + t;
    for (size_t k = 0; k < rank; ++k, q += cols) {
      const __m128 q0 = _mm_loadu_ps(q);
      for (int r = 0; r < R; ++r) {
        a[r] = _mm_add_ps(a[r], _mm_mul_ps(_mm_set1_ps(p[r * rank + k]), q0));
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (kAccumulate) {
        a[r] = _mm_add_ps(_mm_loadu_ps(base + r * cols + t), _mm_mul_ps(vscale, a[r]));
      }
      _mm_storeu_ps(out + r * cols + t, a[r]);
    }
  }
#endif
  for (; t < len; ++t) {
    for (int r = 0; r < R; ++r) {
      const float s = Dot(p + r * rank, rank, qt + t, cols);
      if constexpr (kAccumulate) {
        out[r * cols + t] = base[r * cols + t] + scale * s;
      } else {
        out[r * cols + t] = s;
      }
    }
  }
}

template <bool kAccumulate>
void DecodeRows(const float* p, size_t rows, size_t rank, const float* qt, size_t cols, size_t j0,
                size_t len, float scale, const float* base, float* out) {
  for (size_t c = 0; c < len; c += kPanel) {
    const size_t w = std::min(kPanel, len - c);
    const float* q = qt + j0 + c;
    size_t i = 0;
    // base is only dereferenced when kAccumulate (it may be null otherwise).
    auto b = [&](size_t row) { return kAccumulate ? base + row * cols + c : nullptr; };
    for (; i + 4 <= rows; i += 4) {
      Tile<4, kAccumulate>(p + i * rank, rank, q, cols, w, scale, b(i), out + i * cols + c);
    }
    switch (rows - i) {
      case 3:
        Tile<3, kAccumulate>(p + i * rank, rank, q, cols, w, scale, b(i), out + i * cols + c);
        break;
      case 2:
        Tile<2, kAccumulate>(p + i * rank, rank, q, cols, w, scale, b(i), out + i * cols + c);
        break;
      case 1:
        Tile<1, kAccumulate>(p + i * rank, rank, q, cols, w, scale, b(i), out + i * cols + c);
        break;
      default:
        break;
    }
  }
}

}  // namespace

void LowRankDecodeRows(const float* p, size_t rows, size_t rank, const float* qt, size_t cols,
                       size_t j0, size_t len, float* out) {
  DecodeRows<false>(p, rows, rank, qt, cols, j0, len, 1.0f, nullptr, out);
}

void LowRankDecodeAccumulateRows(const float* p, size_t rows, size_t rank, const float* qt,
                                 size_t cols, size_t j0, size_t len, float scale, const float* base,
                                 float* out) {
  DecodeRows<true>(p, rows, rank, qt, cols, j0, len, scale, base, out);
}

namespace reference {

void LowRankDecodeRows(const float* p, size_t rows, size_t rank, const float* qt, size_t cols,
                       size_t j0, size_t len, float* out) {
  for (size_t i = 0; i < rows; ++i) {
    for (size_t t = 0; t < len; ++t) out[i * cols + t] = Dot(p + i * rank, rank, qt + j0 + t, cols);
  }
}

void LowRankDecodeAccumulateRows(const float* p, size_t rows, size_t rank, const float* qt,
                                 size_t cols, size_t j0, size_t len, float scale, const float* base,
                                 float* out) {
  for (size_t i = 0; i < rows; ++i) {
    for (size_t t = 0; t < len; ++t) {
      const float s = Dot(p + i * rank, rank, qt + j0 + t, cols);
      out[i * cols + t] = base[i * cols + t] + scale * s;
    }
  }
}

}  // namespace reference
}  // namespace aloe::kernels
