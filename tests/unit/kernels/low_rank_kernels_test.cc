#include "kernels/cpu/low_rank_kernels.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace aloe::kernels {
namespace {

std::vector<float> Normal(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every rank 1..64, odd and even widths around the 4- and 8-column tiles and the 512-column
// panel, row counts around the 4-row tile, and column windows [j0, j0 + len) that start and end
// mid-row: the vector kernels give the reference's bits, written and accumulated.
TEST(LowRankKernelsTest, VectorKernelsMatchTheScalarReferenceBitForBit) {
  const size_t kCols[] = {1, 3, 7, 8, 13, 37, 515, 1031};
  const size_t kRows[] = {1, 2, 3, 4, 5, 7, 9};
  unsigned seed = 1;
  for (size_t rank = 1; rank <= 64; ++rank) {
    const size_t cols = kCols[rank % std::size(kCols)];
    const size_t rows = kRows[rank % std::size(kRows)];
    const std::vector<float> p = Normal(rows * rank, ++seed);
    const std::vector<float> qt = Normal(rank * cols, ++seed);
    const std::vector<float> base = Normal(rows * cols, ++seed);
    // Whole rows, then a window cut at both ends.
    const size_t j0s[] = {0, cols / 3};
    for (size_t j0 : j0s) {
      const size_t len = j0 == 0 ? cols : cols - j0 - (cols - j0) / 4;
      SCOPED_TRACE(testing::Message() << "rank " << rank << " rows " << rows << " cols " << cols
                                      << " j0 " << j0 << " len " << len);
      std::vector<float> got(rows * cols, -7.0f), want(rows * cols, -7.0f);
      LowRankDecodeRows(p.data(), rows, rank, qt.data(), cols, j0, len, got.data());
      reference::LowRankDecodeRows(p.data(), rows, rank, qt.data(), cols, j0, len, want.data());
      EXPECT_TRUE(SameBits(got, want));

      got = want = std::vector<float>(rows * cols, -7.0f);
      LowRankDecodeAccumulateRows(p.data(), rows, rank, qt.data(), cols, j0, len, -0.37f,
                                  base.data(), got.data());
      reference::LowRankDecodeAccumulateRows(p.data(), rows, rank, qt.data(), cols, j0, len, -0.37f,
                                             base.data(), want.data());
      EXPECT_TRUE(SameBits(got, want));

      // In place (base == out).
      got = want = base;
      LowRankDecodeAccumulateRows(p.data(), rows, rank, qt.data(), cols, j0, len, 1.5f, got.data(),
                                  got.data());
      reference::LowRankDecodeAccumulateRows(p.data(), rows, rank, qt.data(), cols, j0, len, 1.5f,
                                             want.data(), want.data());
      EXPECT_TRUE(SameBits(got, want));
      // Nothing outside the window was written (the stride is cols, not len).
      for (size_t i = 0; i < rows; ++i) {
        for (size_t j = 0; j < cols; ++j) {
          if (j < len) continue;
          ASSERT_EQ(got[i * cols + j], base[i * cols + j]) << i << " " << j;
        }
      }
    }
  }
}

// The reference is the definition: element (i, t) is 0 + P[i,0] Qt[0,t] + P[i,1] Qt[1,t] + ...
// rounded after every operation, in k order. Values chosen so that another order or a fused
// multiply-add gives other bits: 1 + 2^-24 rounds to 1 when added in order, while (2^-24 + 2^-24)
// first would survive; 3 * (1/3) fused keeps the product exact.
TEST(LowRankKernelsTest, SumsInKOrderWithoutFusedMultiplyAdd) {
  const float third = 1.0f / 3.0f;
  const float tiny = 0x1p-24f;
  // rank 3, one row, 9 columns (one 8-wide tile and a scalar tail), all columns alike.
  const float p[3] = {1.0f, 1.0f, 1.0f};
  std::vector<float> qt(3 * 9);
  for (size_t t = 0; t < 9; ++t) {
    qt[0 * 9 + t] = 1.0f;
    qt[1 * 9 + t] = tiny;
    qt[2 * 9 + t] = tiny;
  }
  std::vector<float> out(9);
  LowRankDecodeRows(p, 1, 3, qt.data(), 9, 0, 9, out.data());
  for (size_t t = 0; t < 9; ++t) EXPECT_EQ(out[t], 1.0f) << t;

  // scale * s rounded before the add: 3 * fl(1/3) = 1 exactly after rounding, 1 - 1 = 0; fused,
  // 3 * fl(1/3) - 1 would be 2^-25.
  const float p1[1] = {third};
  std::vector<float> qt1(9, 1.0f);
  std::vector<float> acc(9, -1.0f);
  LowRankDecodeAccumulateRows(p1, 1, 1, qt1.data(), 9, 0, 9, 3.0f, acc.data(), acc.data());
  for (size_t t = 0; t < 9; ++t) EXPECT_EQ(acc[t], 0.0f) << t;
}

}  // namespace
}  // namespace aloe::kernels
