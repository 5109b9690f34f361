#include "common/low_rank.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "tests/testing/low_rank_testing.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::RandomMatrix;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// n x k matrix (row-major, double) with orthonormal columns: Gram-Schmidt of a random matrix,
// written here independently of the library.
std::vector<double> RandomOrthonormal(size_t n, size_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 1);
  std::vector<double> u(n * k);
  for (double& v : u) v = normal(rng);
  for (size_t c = 0; c < k; ++c) {
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t d = 0; d < c; ++d) {
        double dot = 0;
        for (size_t i = 0; i < n; ++i) dot += u[i * k + c] * u[i * k + d];
        for (size_t i = 0; i < n; ++i) u[i * k + c] -= dot * u[i * k + d];
      }
    }
    double norm = 0;
    for (size_t i = 0; i < n; ++i) norm += u[i * k + c] * u[i * k + c];
    norm = std::sqrt(norm);
    for (size_t i = 0; i < n; ++i) u[i * k + c] /= norm;
  }
  return u;
}

// U diag(sigma) V^T with random orthonormal U (rows x k) and V (cols x k), k = sigma.size().
std::vector<double> MatrixWithSpectrum(size_t rows, size_t cols, const std::vector<double>& sigma,
                                       uint32_t seed) {
  const size_t k = sigma.size();
  const std::vector<double> u = RandomOrthonormal(rows, k, seed);
  const std::vector<double> v = RandomOrthonormal(cols, k, seed + 1);
  std::vector<double> m(rows * cols, 0.0);
  for (size_t i = 0; i < rows; ++i) {
    for (size_t j = 0; j < cols; ++j) {
      double s = 0;
      for (size_t c = 0; c < k; ++c) s += u[i * k + c] * sigma[c] * v[j * k + c];
      m[i * cols + j] = s;
    }
  }
  return m;
}

std::vector<float> ToFloat(const std::vector<double>& d) { return {d.begin(), d.end()}; }

double Norm(const std::vector<float>& a) { return std::sqrt(FrobeniusNormSquared(a)); }

double DistanceBetween(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return std::sqrt(s);
}

std::vector<float> Decode(const LowRankFactors& f) {
  std::vector<float> out(static_cast<size_t>(f.rows) * f.cols);
  EXPECT_THAT(DecompressLowRank(f, absl::MakeSpan(out)), IsOk());
  return out;
}

// max |P^T P - I|.
double OrthonormalityDefect(const LowRankFactors& f) {
  double worst = 0;
  for (size_t a = 0; a < f.rank; ++a) {
    for (size_t b = 0; b < f.rank; ++b) {
      double dot = 0;
      for (size_t i = 0; i < f.rows; ++i) {
        dot += static_cast<double>(f.p[i * f.rank + a]) * f.p[i * f.rank + b];
      }
      worst = std::max(worst, std::abs(dot - (a == b ? 1.0 : 0.0)));
    }
  }
  return worst;
}

bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// sqrt(sum_{i >= r} s_i^2): the Frobenius error of the best rank-r approximation.
double OptimalError(const std::vector<double>& sv, size_t r) {
  double s = 0;
  for (size_t i = r; i < sv.size(); ++i) s += sv[i] * sv[i];
  return std::sqrt(s);
}

TEST(LowRankCompressTest, MatrixOfExactRankIsRecoveredInOneRound) {
  // M = A B^T of rank 6. P = M Q0 spans range(A) for a generic Q0, so one power iteration is
  // exact up to float rounding: no warm-started rounds are needed.
  constexpr uint32_t kRows = 96, kCols = 80, kRank = 6;
  const std::vector<float> a = RandomMatrix(kRows, kRank, 1);
  const std::vector<float> b = RandomMatrix(kCols, kRank, 2);
  std::vector<float> m(kRows * kCols, 0.0f);
  for (size_t i = 0; i < kRows; ++i) {
    for (size_t j = 0; j < kCols; ++j) {
      for (size_t k = 0; k < kRank; ++k) m[i * kCols + j] += a[i * kRank + k] * b[j * kRank + k];
    }
  }
  auto f = CompressLowRank(m, kRows, kCols, kRank, {}, 7);
  ASSERT_THAT(f, IsOk());
  EXPECT_EQ(f->p.size(), kRows * kRank);
  EXPECT_EQ(f->q.size(), kCols * kRank);
  EXPECT_LT(OrthonormalityDefect(*f), 1e-6);
  EXPECT_LT(DistanceBetween(Decode(*f), m) / Norm(m), 1e-5);
}

TEST(LowRankCompressTest, TinyAndHugeMatricesKeepTheirPrecisionOverWarmRounds) {
  // A warm start carries ||M||; were it used unscaled, M Q0 would be of order ||M||^2: about
  // 1e-41 (subnormal float, 0.3% error) for ||M|| = 4e-21 and 1e39 (overflow) for 4e19.
  constexpr uint32_t kRows = 30, kCols = 20, kRank = 3;
  const std::vector<double> base = MatrixWithSpectrum(kRows, kCols, {3.0, 2.0, 1.0}, 31);
  for (double scale : {1e-21, 1e19}) {
    std::vector<float> m(base.size());
    for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(base[i] * scale);
    std::vector<float> warm;
    for (int round = 0; round < 3; ++round) {
      auto f = CompressLowRank(m, kRows, kCols, kRank, warm, 1);
      ASSERT_THAT(f, IsOk()) << scale << " round " << round;
      EXPECT_LT(DistanceBetween(Decode(*f), m) / Norm(m), 1e-5) << scale << " round " << round;
      warm = f->q;
    }
  }
}

TEST(LowRankCompressTest, RankAboveTheMatrixRankAndZeroMatricesStayFiniteAndOrthonormal) {
  // Rank 2 matrix, compressed at rank 5: three columns of P vanish and are replaced.
  constexpr uint32_t kRows = 20, kCols = 12;
  const std::vector<float> m = ToFloat(MatrixWithSpectrum(kRows, kCols, {3.0, 1.0}, /*seed=*/11));
  auto f = CompressLowRank(m, kRows, kCols, 5, {}, 3);
  ASSERT_THAT(f, IsOk());
  EXPECT_TRUE(AllFinite(f->p) && AllFinite(f->q));
  EXPECT_LT(OrthonormalityDefect(*f), 1e-6);
  EXPECT_LT(DistanceBetween(Decode(*f), m) / Norm(m), 1e-5);

  // A zero matrix: P is the replacement basis, Q is zero, the decode is exactly zero.
  const std::vector<float> zero(kRows * kCols, 0.0f);
  auto z = CompressLowRank(zero, kRows, kCols, 4, {}, 3);
  ASSERT_THAT(z, IsOk());
  EXPECT_TRUE(AllFinite(z->p));
  EXPECT_LT(OrthonormalityDefect(*z), 1e-12);
  for (float v : z->q) EXPECT_EQ(v, 0.0f);
  for (float v : Decode(*z)) EXPECT_EQ(v, 0.0f);

  // Warm-starting the zero matrix's round with its zero q still gives a finite orthonormal P.
  auto again = CompressLowRank(m, kRows, kCols, 4, z->q, 3);
  ASSERT_THAT(again, IsOk());
  EXPECT_LT(OrthonormalityDefect(*again), 1e-6);
}

TEST(LowRankCompressTest, WarmStartsApproachTheOptimalErrorMonotonically) {
  // Known spectrum s_i = 0.8^i, i = 0..39: the best rank-4 error is sqrt(sum_{i>=4} s_i^2)
  // = 0.8^4 sqrt((1 - 0.64^36) / (1 - 0.64)) = 0.4096 * 1.66667 = 0.68267.
  constexpr uint32_t kRows = 64, kCols = 48, kRank = 4;
  std::vector<double> sigma(40);
  for (size_t i = 0; i < sigma.size(); ++i) sigma[i] = std::pow(0.8, static_cast<double>(i));
  const std::vector<double> md = MatrixWithSpectrum(kRows, kCols, sigma, 21);
  const std::vector<float> m = ToFloat(md);
  const double optimal = OptimalError(sigma, kRank);
  EXPECT_NEAR(optimal, 0.68267, 1e-5);

  std::vector<double> ratios;
  std::vector<float> warm;
  for (int round = 0; round < 8; ++round) {
    auto f = CompressLowRank(m, kRows, kCols, kRank, warm, 5);
    ASSERT_THAT(f, IsOk());
    ratios.push_back(DistanceBetween(Decode(*f), m) / optimal);
    warm = f->q;
  }
  // One round from the seeded start is within 26% of the optimum, then each warm start
  // (subspace iteration) brings it closer: within 0.3% after five rounds, 0.05% after eight.
  EXPECT_LT(ratios[0], 1.26);
  for (size_t k = 1; k < ratios.size(); ++k) {
    EXPECT_LE(ratios[k], ratios[k - 1] * (1 + 1e-6)) << "round " << k;
  }
  EXPECT_LT(ratios[4], 1.003);
  EXPECT_LT(ratios[7], 1.0005);
  EXPECT_GE(ratios[7], 1.0 - 1e-5);
}

TEST(LowRankCompressTest, OneRoundOnARandomMatrixIsWithinAFactorOfTheOptimum) {
  // A Gaussian matrix has a flat spectrum; the optimum comes from the Jacobi SVD.
  constexpr uint32_t kRows = 40, kCols = 30, kRank = 5;
  const std::vector<float> m = RandomMatrix(kRows, kCols, 9);
  auto sv = SingularValues(std::vector<double>(m.begin(), m.end()), kRows, kCols);
  ASSERT_THAT(sv, IsOk());
  const double optimal = OptimalError(*sv, kRank);
  auto f = CompressLowRank(m, kRows, kCols, kRank, {}, 1);
  ASSERT_THAT(f, IsOk());
  const double ratio = DistanceBetween(Decode(*f), m) / optimal;
  EXPECT_GE(ratio, 1.0 - 1e-6);
  EXPECT_LT(ratio, 1.15);
}

TEST(LowRankCompressTest, ErrorFeedbackKeepsTheSumOfDecodedUpdatesOnTheSumOfTrueOnes) {
  // 30 rounds of M_t = G + 0.3 N_t (a persistent full-rank direction plus noise), rank 2 of 40.
  // With error feedback sum_t D_t = sum_t M_t - e_t exactly (telescoping), so the drift is the
  // current residual, which levels off once the buffer's leading directions are sent; without
  // it the tail of G that rank 2 misses is lost again every round and the drift grows linearly.
  constexpr uint32_t kRows = 48, kCols = 40, kRank = 2;
  constexpr int kRounds = 30;
  const std::vector<float> g = RandomMatrix(kRows, kCols, 100);
  std::vector<float> sum_true(g.size(), 0.0f), sum_ef(g.size(), 0.0f), sum_plain(g.size(), 0.0f);
  std::vector<float> residual(g.size(), 0.0f);
  std::vector<float> warm_ef, warm_plain;
  double drift_ef_20 = 0, drift_plain_20 = 0;
  for (int t = 1; t <= kRounds; ++t) {
    const std::vector<float> noise = RandomMatrix(kRows, kCols, 200 + t);
    std::vector<float> m(g.size());
    for (size_t i = 0; i < m.size(); ++i) m[i] = g[i] + 0.3f * noise[i];
    for (size_t i = 0; i < m.size(); ++i) sum_true[i] += m[i];

    std::vector<float> with_ef(m.size());
    for (size_t i = 0; i < m.size(); ++i) with_ef[i] = m[i] + residual[i];
    auto f = CompressLowRank(with_ef, kRows, kCols, kRank, warm_ef, 1);
    ASSERT_THAT(f, IsOk());
    warm_ef = f->q;
    ASSERT_THAT(AccumulateLowRankRange(*f, 0, 1.0f, absl::MakeSpan(sum_ef)), IsOk());
    ASSERT_THAT(LowRankResidual(with_ef, *f, absl::MakeSpan(residual)), IsOk());

    auto plain = CompressLowRank(m, kRows, kCols, kRank, warm_plain, 1);
    ASSERT_THAT(plain, IsOk());
    warm_plain = plain->q;
    ASSERT_THAT(AccumulateLowRankRange(*plain, 0, 1.0f, absl::MakeSpan(sum_plain)), IsOk());
    if (t == 20) {
      drift_ef_20 = DistanceBetween(sum_ef, sum_true);
      drift_plain_20 = DistanceBetween(sum_plain, sum_true);
    }
  }
  const double total = Norm(sum_true);
  const double drift_ef = DistanceBetween(sum_ef, sum_true);
  const double drift_plain = DistanceBetween(sum_plain, sum_true);
  // The drift is the residual, up to float rounding of 30 accumulations.
  EXPECT_NEAR(drift_ef, Norm(residual), 1e-4 * total);
  // Measured: from round 20 to 30 the drift grows 1.10x with error feedback (it levels off)
  // and 1.50x without (linear growth: 30/20); at round 30 it is 0.38 of ||sum M|| with error
  // feedback and 0.91 without.
  EXPECT_LT(drift_ef / drift_ef_20, 1.15);
  EXPECT_GT(drift_plain / drift_plain_20, 1.35);
  EXPECT_LT(drift_ef / total, 0.40);
  EXPECT_GT(drift_plain / total, 0.90);
  EXPECT_LT(drift_ef, 0.45 * drift_plain);
}

// A 37 x 53 matrix compressed at rank 5, and its full decode.
class LowRankDecodeTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kRows = 37, kCols = 53, kRank = 5;
  void SetUp() override {
    auto compressed = CompressLowRank(RandomMatrix(kRows, kCols, 4), kRows, kCols, kRank, {}, 2);
    ASSERT_THAT(compressed, IsOk());
    factors_ = *std::move(compressed);
    full_ = Decode(factors_);
  }
  LowRankFactors factors_;
  std::vector<float> full_;
};

TEST_F(LowRankDecodeTest, RangeDecodesEqualTheFullDecodeBitForBit) {
  const LowRankFactors* f = &factors_;
  const std::vector<float>& full = full_;

  // Row ranges [a, b), as the server decodes a push chunk by chunk.
  std::vector<float> by_rows(full.size(), 0.0f);
  for (uint32_t a = 0; a < kRows; a += 10) {
    const uint32_t b = std::min(kRows, a + 10);
    ASSERT_THAT(AccumulateLowRankRange(*f, static_cast<uint64_t>(a) * kCols, 1.0f,
                                       absl::MakeSpan(by_rows.data() + a * kCols, (b - a) * kCols)),
                IsOk());
  }
  EXPECT_EQ(std::memcmp(by_rows.data(), full.data(), full.size() * sizeof(float)), 0);

  // Flat ranges that start and end inside rows (FSDP slices of the flattened tensor).
  std::vector<float> by_slices(full.size(), 0.0f);
  const size_t cuts[] = {0, 1, 52, 53, 54, 300, 999, 1000, 1960, full.size()};
  for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
    ASSERT_THAT(
        AccumulateLowRankRange(*f, cuts[c], 1.0f,
                               absl::MakeSpan(by_slices.data() + cuts[c], cuts[c + 1] - cuts[c])),
        IsOk());
  }
  EXPECT_EQ(std::memcmp(by_slices.data(), full.data(), full.size() * sizeof(float)), 0);

  // Accumulation with a scale onto existing values.
  std::vector<float> base = RandomMatrix(kRows, kCols, 5);
  std::vector<float> accumulated = base;
  ASSERT_THAT(AccumulateLowRankRange(*f, 0, -0.5f, absl::MakeSpan(accumulated)), IsOk());
  for (size_t i = 0; i < full.size(); ++i) {
    ASSERT_FLOAT_EQ(accumulated[i], base[i] - 0.5f * full[i]) << i;
  }
}

TEST_F(LowRankDecodeTest, StreamedRowBlocksEqualTheFullDecodeBitForBit) {
  const LowRankFactors* f = &factors_;
  const std::vector<float>& full = full_;
  auto decoder = LowRankRowDecoder::Create(f->q, kRows, kCols, kRank);
  ASSERT_THAT(decoder, IsOk());
  std::vector<float> streamed(full.size(), 0.0f);
  const uint32_t cuts[] = {0, 1, 9, 10, 36, 37};
  for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
    const uint32_t a = cuts[c], b = cuts[c + 1];
    ASSERT_THAT(
        decoder->AccumulateRows(a, absl::MakeConstSpan(f->p.data() + a * kRank, (b - a) * kRank),
                                1.0f, absl::MakeSpan(streamed.data() + a * kCols, (b - a) * kCols)),
        IsOk());
  }
  EXPECT_EQ(std::memcmp(streamed.data(), full.data(), full.size() * sizeof(float)), 0);

  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  std::vector<float> out(2 * kCols, 3.0f);
  std::vector<float> p_rows(f->p.begin(), f->p.begin() + 2 * kRank);
  EXPECT_THAT(
      decoder->AccumulateRows(0, absl::MakeConstSpan(p_rows.data(), 7), 1.0f, absl::MakeSpan(out)),
      StatusIs(kInvalid, HasSubstr("not whole rows")));
  EXPECT_THAT(decoder->AccumulateRows(36, p_rows, 1.0f, absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("rows [36, 38) end past the 37 rows")));
  EXPECT_THAT(decoder->AccumulateRows(0, p_rows, 1.0f, absl::MakeSpan(out.data(), kCols)),
              StatusIs(kInvalid, HasSubstr("output has 53 values")));
  p_rows[6] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(decoder->AccumulateRows(0, p_rows, 1.0f, absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("p[6]")));
  for (float v : out) EXPECT_EQ(v, 3.0f);
  std::vector<float> bad_q = f->q;
  bad_q[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(LowRankRowDecoder::Create(bad_q, kRows, kCols, kRank),
              StatusIs(kInvalid, HasSubstr("q[2]")));
  EXPECT_THAT(LowRankRowDecoder::Create(f->q, kRows, kCols, kRank + 1),
              StatusIs(kInvalid, HasSubstr("q has 265 values")));
}

// Every decode path gives, bit for bit, the element-wise definition: 0 + P[i,0] Q[j,0] +
// P[i,1] Q[j,1] + ... rounded after every float operation, in k order; written, scaled onto a
// base, or subtracted. Odd shapes, ranks 1..64, ranges cut mid-row and row blocks.
TEST(LowRankDecodeDefinitionTest, EveryPathMatchesThePlainLoopForRanksUpTo64) {
  for (uint32_t rank = 1; rank <= 64; rank += (rank < 8 ? 1 : 7)) {
    const uint32_t rows = 67 + rank % 5, cols = 65 + 2 * (rank % 7);
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols << " rank " << rank);
    LowRankFactors f;
    f.rows = rows;
    f.cols = cols;
    f.rank = rank;
    f.p = RandomMatrix(rows, rank, 100 + rank);
    f.q = RandomMatrix(cols, rank, 200 + rank);
    std::vector<float> want(rows * cols);
    for (size_t i = 0; i < rows; ++i) {
      for (size_t j = 0; j < cols; ++j) {
        float s = 0.0f;
        for (size_t k = 0; k < rank; ++k) {
          const volatile float product = f.p[i * rank + k] * f.q[j * rank + k];
          s += product;
        }
        want[i * cols + j] = s;
      }
    }
    std::vector<float> got(want.size());
    ASSERT_THAT(DecompressLowRank(f, absl::MakeSpan(got)), IsOk());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);

    const std::vector<float> base = RandomMatrix(rows, cols, 300 + rank);
    const float scale = 0.75f;
    std::vector<float> want_acc(want.size());
    for (size_t e = 0; e < want.size(); ++e) {
      const volatile float scaled = scale * want[e];
      want_acc[e] = base[e] + scaled;
    }
    std::vector<float> acc = base;
    const size_t cuts[] = {0, 1, cols - 1, 3 * cols + 5, 7 * cols, 7 * cols + 2, want.size()};
    for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
      ASSERT_THAT(
          AccumulateLowRankRange(f, cuts[c], scale,
                                 absl::MakeSpan(acc.data() + cuts[c], cuts[c + 1] - cuts[c])),
          IsOk());
    }
    EXPECT_EQ(std::memcmp(acc.data(), want_acc.data(), want.size() * sizeof(float)), 0);

    auto decoder = LowRankRowDecoder::Create(f.q, rows, cols, rank);
    ASSERT_THAT(decoder, IsOk());
    std::vector<float> streamed = base;
    for (uint32_t a = 0; a < rows; a += 6) {
      const uint32_t b = std::min(rows, a + 6);
      ASSERT_THAT(decoder->AccumulateRows(
                      a, absl::MakeConstSpan(f.p.data() + a * rank, (b - a) * rank), scale,
                      absl::MakeSpan(streamed.data() + a * cols, (b - a) * cols)),
                  IsOk());
    }
    EXPECT_EQ(std::memcmp(streamed.data(), want_acc.data(), want.size() * sizeof(float)), 0);

    std::vector<float> residual(want.size());
    ASSERT_THAT(LowRankResidual(base, f, absl::MakeSpan(residual)), IsOk());
    for (size_t e = 0; e < want.size(); ++e) ASSERT_EQ(residual[e], base[e] - want[e]) << e;
  }
}

TEST(LowRankResidualTest, IsTheMatrixMinusTheDecodeAndWorksInPlace) {
  constexpr uint32_t kRows = 16, kCols = 24;
  const std::vector<float> m = RandomMatrix(kRows, kCols, 6);
  auto f = CompressLowRank(m, kRows, kCols, 3, {}, 2);
  ASSERT_THAT(f, IsOk());
  const std::vector<float> full = Decode(*f);
  std::vector<float> residual(m.size());
  ASSERT_THAT(LowRankResidual(m, *f, absl::MakeSpan(residual)), IsOk());
  for (size_t i = 0; i < m.size(); ++i) ASSERT_EQ(residual[i], m[i] - full[i]) << i;
  std::vector<float> in_place = m;
  ASSERT_THAT(LowRankResidual(in_place, *f, absl::MakeSpan(in_place)), IsOk());
  EXPECT_EQ(in_place, residual);
}

TEST(LowRankCompressTest, SeededInitIsDeterministicAndNestedAcrossRanks) {
  const std::vector<float> m = RandomMatrix(12, 10, 8);
  auto a = CompressLowRank(m, 12, 10, 3, {}, 42);
  auto b = CompressLowRank(m, 12, 10, 3, {}, 42);
  auto c = CompressLowRank(m, 12, 10, 3, {}, 43);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(a->p, b->p);
  EXPECT_EQ(a->q, b->q);
  EXPECT_NE(a->p, c->p);

  const std::vector<float> q3 = SeededLowRankInit(10, 3, 42);
  const std::vector<float> q5 = SeededLowRankInit(10, 5, 42);
  for (size_t j = 0; j < 10; ++j) {
    for (size_t k = 0; k < 3; ++k) EXPECT_EQ(q3[j * 3 + k], q5[j * 5 + k]);
  }
  for (float v : q5) EXPECT_TRUE(v >= -1.0f && v < 1.0f);

  // Growing a warm start keeps the old columns and seeds the new ones; shrinking truncates.
  auto grown = ResizeWarmStart(a->q, 10, 3, 5, 42);
  ASSERT_THAT(grown, IsOk());
  for (size_t j = 0; j < 10; ++j) {
    for (size_t k = 0; k < 5; ++k) {
      EXPECT_EQ((*grown)[j * 5 + k], k < 3 ? a->q[j * 3 + k] : q5[j * 5 + k]);
    }
  }
  auto shrunk = ResizeWarmStart(a->q, 10, 3, 1, 42);
  ASSERT_THAT(shrunk, IsOk());
  for (size_t j = 0; j < 10; ++j) EXPECT_EQ((*shrunk)[j], a->q[j * 3]);
  EXPECT_THAT(ResizeWarmStart(a->q, 10, 2, 4, 42),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cols * old_rank")));
}

TEST(LowRankCompressTest, BadInputsAreRefusedNamingTheProblem) {
  const std::vector<float> m = RandomMatrix(4, 3, 1);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(CompressLowRank(m, 4, 3, 0, {}, 1), StatusIs(kInvalid, HasSubstr("rank 0")));
  EXPECT_THAT(CompressLowRank(m, 4, 3, 4, {}, 1),
              StatusIs(kInvalid, HasSubstr("exceeds min(rows, cols) = 3")));
  EXPECT_THAT(CompressLowRank(m, 4, 4, 2, {}, 1),
              StatusIs(kInvalid, HasSubstr("matrix has 12 values")));
  EXPECT_THAT(CompressLowRank(m, 0, 3, 1, {}, 1), StatusIs(kInvalid, HasSubstr("0 x 3")));
  std::vector<float> nan = m;
  nan[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(CompressLowRank(nan, 4, 3, 2, {}, 1), StatusIs(kInvalid, HasSubstr("m[5]")));
  std::vector<float> warm(3 * 2, 1.0f);
  EXPECT_THAT(CompressLowRank(m, 4, 3, 1, warm, 1),
              StatusIs(kInvalid, HasSubstr("warm start q has 6 values")));
  warm[1] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(CompressLowRank(m, 4, 3, 2, warm, 1), StatusIs(kInvalid, HasSubstr("warm_q[1]")));
  std::vector<float> huge(m.size(), 3e38f);
  EXPECT_THAT(CompressLowRank(huge, 4, 3, 1, {}, 1), StatusIs(kInvalid, HasSubstr("overflows")));

  auto f = CompressLowRank(m, 4, 3, 2, {}, 1);
  ASSERT_THAT(f, IsOk());
  std::vector<float> out(12, 7.0f);
  LowRankFactors bad = *f;
  bad.q.pop_back();
  EXPECT_THAT(DecompressLowRank(bad, absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("q has 5 values")));
  bad = *f;
  bad.p[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(AccumulateLowRankRange(bad, 0, 1.0f, absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("p[3]")));
  bad = *f;
  bad.rank = 3;
  EXPECT_THAT(ValidateLowRankFactors(bad), StatusIs(kInvalid, HasSubstr("p has 8 values")));
  EXPECT_THAT(AccumulateLowRankRange(*f, 5, 1.0f, absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("range [5, 17) ends past")));
  EXPECT_THAT(AccumulateLowRankRange(*f, 0, std::nanf(""), absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("scale")));
  EXPECT_THAT(DecompressLowRank(*f, absl::MakeSpan(out.data(), 11)),
              StatusIs(kInvalid, HasSubstr("output has 11 values")));
  // Nothing was written by the refused decodes.
  for (float v : out) EXPECT_EQ(v, 7.0f);
  EXPECT_THAT(LowRankResidual(absl::MakeConstSpan(m.data(), 11), *f, absl::MakeSpan(out)),
              StatusIs(kInvalid, HasSubstr("matrix has 11 values")));
}

TEST(SingularValuesTest, MatchesHandComputedAndConstructedSpectra) {
  // diag(3, 4) -> 4, 3.
  auto d = SingularValues({3, 0, 0, 4}, 2, 2);
  ASSERT_THAT(d, IsOk());
  EXPECT_NEAR((*d)[0], 4.0, 1e-15);
  EXPECT_NEAR((*d)[1], 3.0, 1e-15);
  // Wide [[1, 1, 0], [0, 0, 1]]: A A^T = diag(2, 1), so sqrt(2) and 1.
  auto w = SingularValues({1, 1, 0, 0, 0, 1}, 2, 3);
  ASSERT_THAT(w, IsOk());
  EXPECT_NEAR((*w)[0], std::sqrt(2.0), 1e-15);
  EXPECT_NEAR((*w)[1], 1.0, 1e-15);
  // [[1, 2], [3, 4]]: s^2 = (30 +- sqrt(30^2 - 4 * 2^2)) / 2 = 15 +- sqrt(221).
  auto g = SingularValues({1, 2, 3, 4}, 2, 2);
  ASSERT_THAT(g, IsOk());
  EXPECT_NEAR((*g)[0], std::sqrt(15 + std::sqrt(221.0)), 1e-14);
  EXPECT_NEAR((*g)[1], std::sqrt(15 - std::sqrt(221.0)), 1e-14);
  // A 30 x 50 matrix built with singular values 10, 9, ..., 1.
  std::vector<double> sigma;
  for (int s = 10; s >= 1; --s) sigma.push_back(s);
  auto c = SingularValues(MatrixWithSpectrum(30, 50, sigma, 3), 30, 50);
  ASSERT_THAT(c, IsOk());
  ASSERT_EQ(c->size(), 30u);
  for (size_t i = 0; i < sigma.size(); ++i) EXPECT_NEAR((*c)[i], sigma[i], 1e-12) << i;
  for (size_t i = sigma.size(); i < c->size(); ++i) EXPECT_NEAR((*c)[i], 0.0, 1e-12) << i;
  EXPECT_THAT(SingularValues({1, 2, 3}, 2, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 values")));
}

TEST(SingularValuesTest, FactorSpectrumIsTheSpectrumOfPTimesQTransposed) {
  // P = the first three columns of I_6 (orthonormal), Q = [[3,0,0],[0,2,0],[0,0,1],[0,0,0]]:
  // P Q^T has singular values 3, 2, 1.
  LowRankFactors f{.rows = 6, .cols = 4, .rank = 3};
  f.p.assign(18, 0.0f);
  for (size_t k = 0; k < 3; ++k) f.p[k * 3 + k] = 1.0f;
  f.q = {3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0};
  auto sv = LowRankSingularValues(f);
  ASSERT_THAT(sv, IsOk());
  EXPECT_THAT(*sv, ElementsAre(::testing::DoubleNear(3, 1e-12), ::testing::DoubleNear(2, 1e-12),
                               ::testing::DoubleNear(1, 1e-12)));

  // After warm-started rounds on s_i = 0.8^i the factors show the leading values.
  std::vector<double> sigma(40);
  for (size_t i = 0; i < sigma.size(); ++i) sigma[i] = std::pow(0.8, static_cast<double>(i));
  const std::vector<float> m = ToFloat(MatrixWithSpectrum(64, 48, sigma, 21));
  std::vector<float> warm;
  LowRankFactors last;
  for (int round = 0; round < 8; ++round) {
    auto r = CompressLowRank(m, 64, 48, 4, warm, 5);
    ASSERT_THAT(r, IsOk());
    warm = r->q;
    last = *r;
  }
  auto leading = LowRankSingularValues(last);
  ASSERT_THAT(leading, IsOk());
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR((*leading)[i], sigma[i], 2e-3 * sigma[i]) << i;
}

TEST(EffectiveRankTest, GoldenSpectra) {
  // Entropy effective rank exp(H(p)), p_i = s_i / sum s.
  // (1,1,1,1): p = 1/4 each, H = ln 4, exp = 4.
  EXPECT_NEAR(*EntropyEffectiveRank({1, 1, 1, 1}), 4.0, 1e-12);
  // (5,0,0): p = (1,0,0), H = 0, exp = 1.
  EXPECT_NEAR(*EntropyEffectiveRank({5, 0, 0}), 1.0, 1e-12);
  // (3,1): p = (0.75, 0.25), H = 0.75 * 0.287682 + 0.25 * 1.386294 = 0.562335,
  // exp(0.562335) = 1.754765.
  EXPECT_NEAR(*EntropyEffectiveRank({3, 1}), 1.754765, 1e-6);
  EXPECT_EQ(*EntropyEffectiveRank({0, 0}), 0.0);
  EXPECT_THAT(EntropyEffectiveRank({1, -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));

  // Energy rank: s = (4,2,1,1), energies 16, 4, 1, 1, total 22.
  // Cumulative shares: 0.727, 0.909, 0.955, 1.
  EXPECT_EQ(*EnergyRank({4, 2, 1, 1}, 22, 0.9), 2u);
  EXPECT_EQ(*EnergyRank({4, 2, 1, 1}, 22, 0.95), 3u);
  EXPECT_EQ(*EnergyRank({4, 2, 1, 1}, 22, 0.7), 1u);
  EXPECT_EQ(*EnergyRank({4, 2, 1, 1}, 22, 1.0), 4u);
  // Total 30: 8 units of energy lie beyond the four values; 0.9 * 30 = 27 > 22 is not reached.
  EXPECT_EQ(*EnergyRank({4, 2, 1, 1}, 30, 0.9), 5u);
  EXPECT_EQ(*EnergyRank({0, 0}, 0, 0.9), 0u);
  EXPECT_THAT(EnergyRank({1}, 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fraction")));
}

// Factors whose P Q^T has the given singular values: P = the first columns of I_rows and Q
// diagonal.
LowRankFactors FactorsWithSpectrum(uint32_t rows, uint32_t cols, const std::vector<float>& s) {
  LowRankFactors f{.rows = rows, .cols = cols, .rank = static_cast<uint32_t>(s.size())};
  f.p.assign(static_cast<size_t>(rows) * f.rank, 0.0f);
  f.q.assign(static_cast<size_t>(cols) * f.rank, 0.0f);
  for (size_t k = 0; k < s.size(); ++k) {
    f.p[k * f.rank + k] = 1.0f;
    f.q[k * f.rank + k] = s[k];
  }
  return f;
}

TEST(AdaptiveRankTest, ScriptedSpectraGiveTheExpectedRanksAndLocalSteps) {
  AdaptiveRankConfig config{.window = 3,
                            .energy_fraction = 0.9,
                            .initial_rank = 4,
                            .min_rank = 1,
                            .max_rank = 8,
                            .initial_local_steps = 100,
                            .min_local_steps = 10,
                            .max_local_steps = 1000};
  ASSERT_THAT(ValidateAdaptiveRankConfig(config), IsOk());
  AdaptiveRank adaptive(config);
  EXPECT_EQ(adaptive.NextRank("w"), 4u);
  EXPECT_EQ(adaptive.NextLocalSteps(), 100u);

  // Layer w, 16 x 16 (16 + 16 = 32 floats per rank), compressed at rank 4, so
  // H = round(100 * 32 rank / (32 * 4)) = round(25 rank).
  struct Step {
    std::vector<float> spectrum;
    double energy;         // ||M||_F^2
    uint32_t effective;    // the effective rank Observe records
    uint32_t next_rank;    // ceil(mean of the last 3), clamped to [1, 8]
    uint32_t local_steps;  // round(25 next_rank), clamped to [10, 1000]
  };
  const Step steps[] = {
      // (4,2,1,1), energies 16,4,1,1 of 22: 20/22 >= 0.9 at rank 2. Window [2].
      {{4, 2, 1, 1}, 22, 2, 2, 50},
      // (1,1,1,1) of 4: 0.9 * 4 = 3.6 needs all 4. Window [2,4]: mean 3.
      {{1, 1, 1, 1}, 4, 4, 3, 75},
      // The same factors of a matrix with ||M||^2 = 8: half its energy lies beyond rank 4, so
      // the effective rank is taken as 2 * 4. Window [2,4,8]: mean 4.67, ceiling 5.
      {{1, 1, 1, 1}, 8, 8, 5, 125},
      // (1,0,0,0) of 1: rank 1. Window [4,8,1] (the 2 left): mean 4.33 -> 5.
      {{1, 0, 0, 0}, 1, 1, 5, 125},
      // A zero pseudo-gradient: rank 0. Window [8,1,0]: mean 3.
      {{0, 0, 0, 0}, 0, 0, 3, 75},
      // Two zeros more: window [0,0,0], mean 0, clamped to min_rank 1.
      {{0, 0, 0, 0}, 0, 0, 1, 25},
      {{0, 0, 0, 0}, 0, 0, 1, 25},
  };
  for (size_t i = 0; i < std::size(steps); ++i) {
    const Step& step = steps[i];
    auto effective = adaptive.Observe("w", FactorsWithSpectrum(16, 16, step.spectrum), step.energy);
    ASSERT_THAT(effective, IsOk());
    EXPECT_EQ(*effective, step.effective) << "step " << i;
    EXPECT_EQ(adaptive.NextRank("w"), step.next_rank) << "step " << i;
    EXPECT_EQ(adaptive.NextLocalSteps(), step.local_steps) << "step " << i;
  }

  // Layer b, 2 x 30 (32 floats per rank), caps every rank at min(2, 30) = 2, its initial rank
  // included. s = (3, 3) with ||M||^2 = 18: energy rank 2. H = round(100 * (32*1 + 32*2) /
  // (32*4 + 32*2)) = round(50) = 50.
  EXPECT_EQ(*adaptive.Observe("b", FactorsWithSpectrum(2, 30, {3, 3}), 18), 2u);
  EXPECT_EQ(adaptive.NextRank("b"), 2u);
  EXPECT_EQ(adaptive.NextLocalSteps(), 50u);
  // A saturated observation (2 * 2 = 4) is capped at 2 too.
  EXPECT_EQ(*adaptive.Observe("b", FactorsWithSpectrum(2, 30, {1, 1}), 100), 4u);
  EXPECT_EQ(adaptive.NextRank("b"), 2u);

  EXPECT_THAT(adaptive.Observe("b", FactorsWithSpectrum(3, 30, {1, 1}), 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("was observed as 2 x 30")));
}

TEST(AdaptiveRankTest, LocalStepsStayWithinTheirBounds) {
  AdaptiveRankConfig config{.window = 1,
                            .initial_rank = 8,
                            .max_rank = 64,
                            .initial_local_steps = 100,
                            .min_local_steps = 40,
                            .max_local_steps = 150};
  AdaptiveRank adaptive(config);
  // Rank 1 of 8 would give H = 12.5: clamped to 40.
  ASSERT_THAT(adaptive.Observe("w", FactorsWithSpectrum(32, 32, {1, 0, 0, 0, 0, 0, 0, 0}), 1),
              IsOk());
  EXPECT_EQ(adaptive.NextRank("w"), 1u);
  EXPECT_EQ(adaptive.NextLocalSteps(), 40u);
  // Saturated at rank 8: 16, H = 200 clamped to 150.
  ASSERT_THAT(adaptive.Observe("w", FactorsWithSpectrum(32, 32, std::vector<float>(8, 1)), 100),
              IsOk());
  EXPECT_EQ(adaptive.NextRank("w"), 16u);
  EXPECT_EQ(adaptive.NextLocalSteps(), 150u);
}

TEST(AdaptiveRankTest, InvalidConfigsNameTheField) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(ValidateAdaptiveRankConfig({.window = 0}), StatusIs(kInvalid, HasSubstr("window")));
  EXPECT_THAT(ValidateAdaptiveRankConfig({.energy_fraction = 1.5}),
              StatusIs(kInvalid, HasSubstr("energy_fraction")));
  EXPECT_THAT(ValidateAdaptiveRankConfig({.min_rank = 0}),
              StatusIs(kInvalid, HasSubstr("min_rank")));
  EXPECT_THAT(ValidateAdaptiveRankConfig({.initial_rank = 2000}),
              StatusIs(kInvalid, HasSubstr("initial_rank")));
  EXPECT_THAT(ValidateAdaptiveRankConfig({.min_local_steps = 0}),
              StatusIs(kInvalid, HasSubstr("min_local_steps")));
  EXPECT_THAT(ValidateAdaptiveRankConfig({.initial_local_steps = 0}),
              StatusIs(kInvalid, HasSubstr("initial_local_steps")));
  EXPECT_THAT(ValidateAdaptiveRankConfig({}), IsOk());
}

TEST(AdaptiveRankTest, RecordedRanksSaveAndRestoreExactly) {
  AdaptiveRankConfig config{.window = 2, .initial_rank = 4, .initial_local_steps = 60};
  AdaptiveRank adaptive(config);
  // r_0 = 6 for "a" (8 x 16, width 24), 2 for "b" (4 x 4, width 8).
  ASSERT_THAT(adaptive.Record("a", 8, 16, 6, 3), IsOk());
  ASSERT_THAT(adaptive.Record("a", 8, 16, 6, 6), IsOk());
  ASSERT_THAT(adaptive.Record("a", 8, 16, 6, 4), IsOk());  // window [6, 4]: 5
  ASSERT_THAT(adaptive.Record("b", 4, 4, 2, 1), IsOk());
  EXPECT_TRUE(adaptive.Knows("a"));
  EXPECT_FALSE(adaptive.Knows("c"));
  EXPECT_EQ(adaptive.NextRank("a"), 5u);
  // H = round(60 * (24 * 5 + 8 * 1) / (24 * 6 + 8 * 2)) = round(48) = 48.
  EXPECT_EQ(adaptive.NextLocalSteps(), 48u);
  // Refused, nothing recorded: another shape, another r_0, a rank beyond 2 min(rows, cols).
  EXPECT_THAT(adaptive.Record("a", 8, 15, 6, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("was observed as 8 x 16")));
  EXPECT_THAT(adaptive.Record("a", 8, 16, 5, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("initial rank 6")));
  EXPECT_THAT(adaptive.Record("b", 4, 4, 2, 9),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside [0, 8]")));
  EXPECT_EQ(adaptive.NextRank("a"), 5u);

  const std::vector<AdaptiveRank::LayerState> saved = adaptive.Save();
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(saved[0].name, "a");
  EXPECT_EQ(saved[0].recent, (std::vector<uint32_t>{6, 4}));
  AdaptiveRank restored(config);
  ASSERT_THAT(restored.Restore(saved), IsOk());
  EXPECT_EQ(restored.NextRank("a"), 5u);
  EXPECT_EQ(restored.NextRank("b"), 1u);
  EXPECT_EQ(restored.NextLocalSteps(), 48u);
  // The next observation drops the oldest of the restored window, as it would have.
  ASSERT_THAT(restored.Record("a", 8, 16, 6, 8), IsOk());  // [4, 8]: 6
  EXPECT_EQ(restored.NextRank("a"), 6u);

  std::vector<AdaptiveRank::LayerState> bad = saved;
  bad[1].recent = {1, 1, 1};
  EXPECT_THAT(restored.Restore(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("layer b has 3 observations")));
  bad = saved;
  bad[1].name = "a";
  EXPECT_THAT(restored.Restore(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer a appears twice")));
  EXPECT_EQ(restored.NextRank("a"), 6u);  // unchanged by the refusals
}

}  // namespace
}  // namespace aloe
