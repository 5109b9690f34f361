// Decode of low-rank factors (docs/algorithms.md, "Low-rank compression (paper 001)"): rows of
// P Q^T, written or scaled onto a base, for the server's streaming decode and the worker's error
// feedback (common/low_rank.h).
//
// Layout: P is row-major (row i at p + i * rank), Qt is Q transposed (rank x cols, row k at
// qt + k * cols). A call covers rows [0, rows) of p and columns [j0, j0 + len) of the matrix;
// element (i, t) of the output, t < len, is out[i * cols + t] (the rows of a row-major
// rows x cols matrix, starting at column j0), and likewise base.
//
// Rounding, the contract that makes every split of a decode give the same bits: each element is
// s = 0; s = s + P[i,k] * Qt[k, j0 + t] for k = 0, 1, ..., rank - 1, every product and sum a
// float32 operation rounded to nearest (no fused multiply-add, no reordering), then either
// written (s) or added (base + scale * s, again two rounded operations). The vectorised kernels
// run the same operations lane by lane across t, so they match the scalar references in
// aloe::kernels::reference bit for bit.
//
// Both are general row-major products, out = A B with A = P (rows x rank) and B = Qt
// (rank x cols): the encoder's M Q0 is LowRankDecodeRows with M as P and Q0 as Qt.
//
// Contract shared by both kernels (as in outer_kernels.h): single-threaded, no allocation, no
// checks (non-finite values propagate; callers validate). rows or len may be 0. REQUIRES:
// j0 + len <= cols; out does not overlap p or qt; base is null or a buffer of out's layout that
// may be exactly out (then out[e] = out[e] + scale * s) but may not overlap it otherwise.
#pragma once

#include <cstddef>

namespace aloe::kernels {

// out(i, t) = sum_k P[i,k] Qt[k, j0 + t].
void LowRankDecodeRows(const float* p, size_t rows, size_t rank, const float* qt, size_t cols,
                       size_t j0, size_t len, float* out);

// out(i, t) = base(i, t) + scale * sum_k P[i,k] Qt[k, j0 + t]. base == out accumulates in place;
// scale = -1 with base = M gives the residual M - P Q^T bit for bit as M - (P Q^T) would.
void LowRankDecodeAccumulateRows(const float* p, size_t rows, size_t rank, const float* qt,
                                 size_t cols, size_t j0, size_t len, float scale, const float* base,
                                 float* out);

namespace reference {

// Plain scalar loops with the same contracts and bits as above.
void LowRankDecodeRows(const float* p, size_t rows, size_t rank, const float* qt, size_t cols,
                       size_t j0, size_t len, float* out);
void LowRankDecodeAccumulateRows(const float* p, size_t rows, size_t rank, const float* qt,
                                 size_t cols, size_t j0, size_t len, float scale, const float* base,
                                 float* out);

}  // namespace reference
}  // namespace aloe::kernels
