#include "common/low_rank.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/cpu/low_rank_kernels.h"

namespace aloe {
namespace {

// Index of the first NaN or Inf in values, or values.size().
size_t FirstNonFinite(absl::Span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) return i;
  }
  return values.size();
}

absl::Status CheckFiniteNamed(absl::Span<const float> values, const char* name) {
  const size_t bad = FirstNonFinite(values);
  if (bad == values.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("low-rank: %s[%d] is %f (NaN or Inf)", name, bad, values[bad]));
}

absl::Status CheckShape(uint32_t rows, uint32_t cols, uint32_t rank) {
  if (rows == 0 || cols == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: matrix is %d x %d; both dimensions must be > 0", rows, cols));
  }
  if (rank == 0) return absl::InvalidArgumentError("low-rank: rank 0");
  if (rank > std::min(rows, cols)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: rank %d exceeds min(rows, cols) = %d of a %d x %d matrix", rank,
                        std::min(rows, cols), rows, cols));
  }
  return absl::OkStatus();
}

// SplitMix64 finaliser: a well-mixed 64-bit hash.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1), a function of (seed, j, k) only.
float InitValue(uint64_t seed, uint64_t j, uint64_t k) {
  const uint64_t h = Mix(Mix(Mix(seed) ^ j) ^ (k * 0x632be59bd9b4e019ULL));
  return static_cast<float>(static_cast<double>(h >> 40) * (2.0 / 16777216.0) - 1.0);
}

// p (rows x r) = m (rows x cols) q (cols x r), each element summed over j in order from 0. The
// same product as the decode's with m in P's place (cols in the rank's) and q in Q^T's, so the
// decode kernel computes it, with its register tiles.
void MultiplyMQ(const float* m, size_t rows, size_t cols, const float* q, size_t r, float* p) {
  kernels::LowRankDecodeRows(m, rows, cols, q, r, 0, r, p);
}

// q (cols x r) = m^T p, m rows x cols, p rows x r. Four rows of m per pass over q.
void MultiplyMtP(const float* m, size_t rows, size_t cols, const float* p, size_t r, float* q) {
  std::fill(q, q + cols * r, 0.0f);
  size_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    const float* __restrict p0 = p + i * r;
    const float* __restrict p1 = p0 + r;
    const float* __restrict p2 = p1 + r;
    const float* __restrict p3 = p2 + r;
    const float* m0 = m + i * cols;
    for (size_t j = 0; j < cols; ++j) {
      float* __restrict qj = q + j * r;
      const float a0 = m0[j], a1 = m0[cols + j], a2 = m0[2 * cols + j], a3 = m0[3 * cols + j];
#pragma omp simd
      for (size_t k = 0; k < r; ++k) qj[k] += a0 * p0[k] + a1 * p1[k] + a2 * p2[k] + a3 * p3[k];
    }
  }
  for (; i < rows; ++i) {
    const float* __restrict pi = p + i * r;
    const float* mi = m + i * cols;
    for (size_t j = 0; j < cols; ++j) {
      float* __restrict qj = q + j * r;
      const float a = mi[j];
#pragma omp simd
      for (size_t k = 0; k < r; ++k) qj[k] += a * pi[k];
    }
  }
}

double Dot(const double* a, const double* b, size_t n) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Removes from v its components along the first k columns of cols (column-major, length n).
void ProjectOut(const double* cols, size_t k, size_t n, double* v) {
  for (size_t c = 0; c < k; ++c) {
    const double* u = cols + c * n;
    const double d = Dot(u, v, n);
#pragma omp simd
    for (size_t i = 0; i < n; ++i) v[i] -= d * u[i];
  }
}

// Scales each nonzero column of q (n x r, row-major) to unit norm. The span of M Q0, all that the
// orthonormalisation keeps, does not change; a warm start that carries ||M|| would otherwise
// make M Q0 of order ||M||^2 and overflow or underflow float sooner.
void NormalizeColumns(float* q, size_t n, size_t r) {
  std::vector<double> norm(r, 0.0);
  for (size_t j = 0; j < n; ++j) {
    for (size_t k = 0; k < r; ++k) norm[k] += static_cast<double>(q[j * r + k]) * q[j * r + k];
  }
  std::vector<float> inv(r, 1.0f);
  for (size_t k = 0; k < r; ++k) {
    if (norm[k] > 0) inv[k] = static_cast<float>(1.0 / std::sqrt(norm[k]));
  }
  for (size_t j = 0; j < n; ++j) {
    for (size_t k = 0; k < r; ++k) q[j * r + k] *= inv[k];
  }
}

// Below this share of its norm before projection, a column is taken as lying in the span of the
// earlier ones: float data cannot resolve directions much weaker than that.
constexpr double kVanishingColumn = 1e-5;

// Orthonormalises the r columns (length n, column-major, double) in place by modified
// Gram-Schmidt, run twice per column so that orthogonality holds to double rounding even after
// heavy cancellation ("twice is enough"). Householder QR would be as accurate at about the
// same O(n r^2) cost once its explicit factor is formed; column by column, Gram-Schmidt makes
// replacing a vanishing column a local step. A vanishing column becomes the unit vector e_t (t <=
// k, the first with the largest part outside the span of the earlier columns), orthonormalised the
// same way: among e_0..e_k at least one keeps a squared norm >= 1/(k+1) outside a k-dimensional
// span.
void Orthonormalize(double* cols, size_t n, size_t r) {
  std::vector<double> candidate(n);
  for (size_t k = 0; k < r; ++k) {
    double* v = cols + k * n;
    const double before = std::sqrt(Dot(v, v, n));
    ProjectOut(cols, k, n, v);
    ProjectOut(cols, k, n, v);
    double norm = std::sqrt(Dot(v, v, n));
    if (!(norm > kVanishingColumn * before) || before == 0) {
      double best = -1;
      size_t best_t = 0;
      for (size_t t = 0; t <= k && t < n; ++t) {
        std::fill(candidate.begin(), candidate.end(), 0.0);
        candidate[t] = 1.0;
        ProjectOut(cols, k, n, candidate.data());
        const double c = Dot(candidate.data(), candidate.data(), n);
        if (c > best) best = c, best_t = t;
      }
      std::fill(v, v + n, 0.0);
      v[best_t] = 1.0;
      ProjectOut(cols, k, n, v);
      ProjectOut(cols, k, n, v);
      norm = std::sqrt(Dot(v, v, n));
    }
    const double inv = 1.0 / norm;
#pragma omp simd
    for (size_t i = 0; i < n; ++i) v[i] *= inv;
  }
}

// Q (cols x r) transposed to r x cols: each k then adds a contiguous row segment.
std::vector<float> TransposeQ(absl::Span<const float> q, size_t cols, size_t r) {
  std::vector<float> qt(r * cols);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t k = 0; k < r; ++k) qt[k * cols + j] = q[j * r + k];
  }
  return qt;
}

// Splits the flat range [begin, begin + count) of a row-major matrix with `cols` columns into a
// partial first row, a block of whole rows and a partial last row, and calls
// fn(row, rows, j0, len, offset) for each nonempty piece: rows [row, row + rows) x columns
// [j0, j0 + len), whose first element is at `offset` from begin. The decode kernels compute each
// element alone, in k order (kernels/cpu/low_rank_kernels.h), so the bits do not depend on how
// a range is split.
template <typename Fn>
void ForEachRowPiece(size_t cols, uint64_t begin, uint64_t count, Fn fn) {
  uint64_t pos = begin;
  const uint64_t end = begin + count;
  if (pos < end && pos % cols != 0) {
    const size_t j0 = static_cast<size_t>(pos % cols);
    const size_t len = static_cast<size_t>(std::min<uint64_t>(cols - j0, end - pos));
    fn(static_cast<size_t>(pos / cols), size_t{1}, j0, len, static_cast<size_t>(pos - begin));
    pos += len;
  }
  const uint64_t whole = (end - pos) / cols;
  if (whole > 0) {
    fn(static_cast<size_t>(pos / cols), static_cast<size_t>(whole), size_t{0}, cols,
       static_cast<size_t>(pos - begin));
    pos += whole * cols;
  }
  if (pos < end) {
    fn(static_cast<size_t>(pos / cols), size_t{1}, size_t{0}, static_cast<size_t>(end - pos),
       static_cast<size_t>(pos - begin));
  }
}

// out[t] = base[t] + scale * (P Q^T)[begin + t] for t < count (base may be out), or
// out[t] = (P Q^T)[begin + t] when base is null.
void DecodeRange(const LowRankFactors& f, uint64_t begin, uint64_t count, float scale,
                 const float* base, float* out) {
  if (count == 0) return;
  const std::vector<float> qt = TransposeQ(f.q, f.cols, f.rank);
  ForEachRowPiece(
      f.cols, begin, count, [&](size_t row, size_t rows, size_t j0, size_t len, size_t offset) {
        const float* p = f.p.data() + row * f.rank;
        if (base == nullptr) {
          kernels::LowRankDecodeRows(p, rows, f.rank, qt.data(), f.cols, j0, len, out + offset);
        } else {
          kernels::LowRankDecodeAccumulateRows(p, rows, f.rank, qt.data(), f.cols, j0, len, scale,
                                               base + offset, out + offset);
        }
      });
}

}  // namespace

uint64_t LowRankFactorFloats(uint32_t rows, uint32_t cols, uint32_t rank) {
  return (static_cast<uint64_t>(rows) + cols) * rank;
}

std::vector<float> SeededLowRankInit(uint32_t cols, uint32_t rank, uint64_t seed) {
  std::vector<float> q(static_cast<size_t>(cols) * rank);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t k = 0; k < rank; ++k) q[j * rank + k] = InitValue(seed, j, k);
  }
  return q;
}

absl::StatusOr<std::vector<float>> ResizeWarmStart(absl::Span<const float> q, uint32_t cols,
                                                   uint32_t old_rank, uint32_t new_rank,
                                                   uint64_t seed) {
  if (q.size() != static_cast<uint64_t>(cols) * old_rank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: warm start has %d values, not cols * old_rank = %d * %d",
                        q.size(), cols, old_rank));
  }
  if (new_rank == 0) return absl::InvalidArgumentError("low-rank: new rank 0");
  std::vector<float> out(static_cast<size_t>(cols) * new_rank);
  for (size_t j = 0; j < cols; ++j) {
    for (size_t k = 0; k < new_rank; ++k) {
      out[j * new_rank + k] = k < old_rank ? q[j * old_rank + k] : InitValue(seed, j, k);
    }
  }
  return out;
}

absl::StatusOr<LowRankFactors> CompressLowRank(absl::Span<const float> m, uint32_t rows,
                                               uint32_t cols, uint32_t rank,
                                               absl::Span<const float> warm_q, uint64_t seed) {
  ALOE_RETURN_IF_ERROR(CheckShape(rows, cols, rank));
  const uint64_t elements = static_cast<uint64_t>(rows) * cols;
  if (m.size() != elements) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: matrix has %d values, not rows * cols = %d * %d", m.size(), rows, cols));
  }
  if (!warm_q.empty() && warm_q.size() != static_cast<uint64_t>(cols) * rank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: warm start q has %d values, not cols * rank = %d * %d",
                        warm_q.size(), cols, rank));
  }
  ALOE_RETURN_IF_ERROR(CheckFiniteNamed(m, "m"));
  ALOE_RETURN_IF_ERROR(CheckFiniteNamed(warm_q, "warm_q"));

  LowRankFactors f;
  f.rows = rows;
  f.cols = cols;
  f.rank = rank;
  std::vector<float> q0 = warm_q.empty() ? SeededLowRankInit(cols, rank, seed)
                                         : std::vector<float>(warm_q.begin(), warm_q.end());
  NormalizeColumns(q0.data(), cols, rank);
  f.p.resize(static_cast<size_t>(rows) * rank);
  MultiplyMQ(m.data(), rows, cols, q0.data(), rank, f.p.data());
  if (FirstNonFinite(f.p) != f.p.size()) {
    return absl::InvalidArgumentError("low-rank: M * Q overflows float; scale the input down");
  }

  std::vector<double> cols_major(static_cast<size_t>(rows) * rank);
  for (size_t i = 0; i < rows; ++i) {
    for (size_t k = 0; k < rank; ++k) cols_major[k * rows + i] = f.p[i * rank + k];
  }
  Orthonormalize(cols_major.data(), rows, rank);
  for (size_t i = 0; i < rows; ++i) {
    for (size_t k = 0; k < rank; ++k)
      f.p[i * rank + k] = static_cast<float>(cols_major[k * rows + i]);
  }

  f.q.resize(static_cast<size_t>(cols) * rank);
  MultiplyMtP(m.data(), rows, cols, f.p.data(), rank, f.q.data());
  if (FirstNonFinite(f.q) != f.q.size()) {
    return absl::InvalidArgumentError("low-rank: M^T * P overflows float; scale the input down");
  }
  return f;
}

absl::Status ValidateLowRankFactors(const LowRankFactors& f) {
  ALOE_RETURN_IF_ERROR(CheckShape(f.rows, f.cols, f.rank));
  if (f.p.size() != static_cast<uint64_t>(f.rows) * f.rank) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: p has %d values, not rows * rank = %d * %d", f.p.size(), f.rows, f.rank));
  }
  if (f.q.size() != static_cast<uint64_t>(f.cols) * f.rank) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: q has %d values, not cols * rank = %d * %d", f.q.size(), f.cols, f.rank));
  }
  ALOE_RETURN_IF_ERROR(CheckFiniteNamed(f.p, "p"));
  return CheckFiniteNamed(f.q, "q");
}

absl::Status DecompressLowRank(const LowRankFactors& f, absl::Span<float> out) {
  ALOE_RETURN_IF_ERROR(ValidateLowRankFactors(f));
  const uint64_t elements = static_cast<uint64_t>(f.rows) * f.cols;
  if (out.size() != elements) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: output has %d values, not rows * cols = %d", out.size(), elements));
  }
  DecodeRange(f, 0, elements, 1.0f, nullptr, out.data());
  return absl::OkStatus();
}

absl::Status AccumulateLowRankRange(const LowRankFactors& f, uint64_t begin, float scale,
                                    absl::Span<float> out) {
  ALOE_RETURN_IF_ERROR(ValidateLowRankFactors(f));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrFormat("low-rank: scale %f is not finite", scale));
  }
  const uint64_t elements = static_cast<uint64_t>(f.rows) * f.cols;
  if (begin > elements || out.size() > elements - begin) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: range [%d, %d) ends past the %d x %d matrix", begin,
                        begin + out.size(), f.rows, f.cols));
  }
  DecodeRange(f, begin, out.size(), scale, out.data(), out.data());
  return absl::OkStatus();
}

absl::StatusOr<LowRankRowDecoder> LowRankRowDecoder::Create(absl::Span<const float> q,
                                                            uint32_t rows, uint32_t cols,
                                                            uint32_t rank) {
  ALOE_RETURN_IF_ERROR(CheckShape(rows, cols, rank));
  if (q.size() != static_cast<uint64_t>(cols) * rank) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: q has %d values, not cols * rank = %d * %d", q.size(), cols, rank));
  }
  ALOE_RETURN_IF_ERROR(CheckFiniteNamed(q, "q"));
  LowRankRowDecoder decoder;
  decoder.rows_ = rows;
  decoder.cols_ = cols;
  decoder.rank_ = rank;
  decoder.qt_ = TransposeQ(q, cols, rank);
  return decoder;
}

absl::Status LowRankRowDecoder::AccumulateRows(uint32_t row_begin, absl::Span<const float> p_rows,
                                               float scale, absl::Span<float> out) const {
  if (p_rows.size() % rank_ != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: %d values of p are not whole rows of rank %d", p_rows.size(), rank_));
  }
  const uint64_t n = p_rows.size() / rank_;
  if (row_begin > rows_ || n > rows_ - row_begin) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: rows [%d, %d) end past the %d rows", row_begin, row_begin + n, rows_));
  }
  if (out.size() != n * cols_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "low-rank: output has %d values, not %d rows * %d cols", out.size(), n, cols_));
  }
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrFormat("low-rank: scale %f is not finite", scale));
  }
  ALOE_RETURN_IF_ERROR(CheckFiniteNamed(p_rows, "p"));
  if (n == 0) return absl::OkStatus();
  kernels::LowRankDecodeAccumulateRows(p_rows.data(), n, rank_, qt_.data(), cols_, 0, cols_, scale,
                                       out.data(), out.data());
  return absl::OkStatus();
}

absl::Status LowRankResidual(absl::Span<const float> m, const LowRankFactors& f,
                             absl::Span<float> residual) {
  ALOE_RETURN_IF_ERROR(ValidateLowRankFactors(f));
  const uint64_t elements = static_cast<uint64_t>(f.rows) * f.cols;
  if (m.size() != elements || residual.size() != elements) {
    return absl::InvalidArgumentError(
        absl::StrFormat("low-rank: matrix has %d values and residual %d, not rows * cols = %d",
                        m.size(), residual.size(), elements));
  }
  // m and residual may be the same buffer (the kernel allows base == out); m + (-1) * s is
  // m - s bit for bit.
  DecodeRange(f, 0, elements, -1.0f, m.data(), residual.data());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> SingularValues(absl::Span<const double> a, size_t rows,
                                                   size_t cols) {
  if (a.size() != rows * cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "singular values: matrix has %d values, not %d x %d", a.size(), rows, cols));
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("singular values: element %d is NaN or Inf", i));
    }
  }
  // Rotate the fewer vectors: columns of A, or rows (the columns of A^T, same values).
  const bool by_columns = rows >= cols;
  const size_t k = std::min(rows, cols);
  const size_t n = std::max(rows, cols);
  std::vector<double> w(k * n);
  for (size_t i = 0; i < rows; ++i) {
    for (size_t j = 0; j < cols; ++j) {
      if (by_columns) {
        w[j * n + i] = a[i * cols + j];
      } else {
        w[i * n + j] = a[i * cols + j];
      }
    }
  }
  constexpr int kMaxSweeps = 60;
  constexpr double kTolerance = 1e-15;
  for (int sweep = 0; sweep < kMaxSweeps; ++sweep) {
    bool rotated = false;
    for (size_t p = 0; p + 1 < k; ++p) {
      for (size_t q = p + 1; q < k; ++q) {
        double* x = w.data() + p * n;
        double* y = w.data() + q * n;
        const double alpha = Dot(x, x, n);
        const double beta = Dot(y, y, n);
        const double gamma = Dot(x, y, n);
        if (gamma == 0 || std::abs(gamma) <= kTolerance * std::sqrt(alpha * beta)) continue;
        rotated = true;
        const double zeta = (beta - alpha) / (2 * gamma);
        const double t = (zeta >= 0 ? 1.0 : -1.0) / (std::abs(zeta) + std::hypot(1.0, zeta));
        const double c = 1 / std::sqrt(1 + t * t);
        const double s = c * t;
        for (size_t i = 0; i < n; ++i) {
          const double xi = x[i], yi = y[i];
          x[i] = c * xi - s * yi;
          y[i] = s * xi + c * yi;
        }
      }
    }
    if (!rotated) break;
  }
  std::vector<double> sv(k);
  for (size_t c = 0; c < k; ++c) sv[c] = std::sqrt(Dot(w.data() + c * n, w.data() + c * n, n));
  std::sort(sv.begin(), sv.end(), std::greater<double>());
  return sv;
}

absl::StatusOr<std::vector<double>> LowRankSingularValues(const LowRankFactors& f) {
  ALOE_RETURN_IF_ERROR(ValidateLowRankFactors(f));
  const size_t r = f.rank;
  std::vector<double> gram(r * r, 0.0);
  for (size_t j = 0; j < f.cols; ++j) {
    const float* qj = f.q.data() + j * r;
    for (size_t a = 0; a < r; ++a) {
      const double qa = qj[a];
      for (size_t b = 0; b < r; ++b) gram[a * r + b] += qa * qj[b];
    }
  }
  // The Gram matrix is symmetric positive semi-definite: its singular values are its
  // eigenvalues, the squares of Q's singular values.
  ALOE_ASSIGN_OR_RETURN(std::vector<double> eig, SingularValues(gram, r, r));
  for (double& e : eig) e = std::sqrt(e);
  return eig;
}

double FrobeniusNormSquared(absl::Span<const float> m) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (size_t i = 0; i < m.size(); ++i) s += static_cast<double>(m[i]) * m[i];
  return s;
}

absl::StatusOr<double> EntropyEffectiveRank(absl::Span<const double> sv) {
  double sum = 0;
  for (double s : sv) {
    if (!std::isfinite(s) || s < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("effective rank: singular value %f is negative or not finite", s));
    }
    sum += s;
  }
  if (sum == 0) return 0.0;
  double entropy = 0;
  for (double s : sv) {
    if (s == 0) continue;
    const double p = s / sum;
    entropy -= p * std::log(p);
  }
  return std::exp(entropy);
}

absl::StatusOr<uint32_t> EnergyRank(absl::Span<const double> sv, double total_energy,
                                    double fraction) {
  if (!(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("energy rank: fraction %f is outside (0, 1]", fraction));
  }
  if (!std::isfinite(total_energy) || total_energy < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("energy rank: total energy %f is negative or not finite", total_energy));
  }
  for (double s : sv) {
    if (!std::isfinite(s) || s < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("energy rank: singular value %f is negative or not finite", s));
    }
  }
  if (total_energy == 0) return 0u;
  const double target = fraction * total_energy;
  double cumulative = 0;
  for (size_t k = 0; k < sv.size(); ++k) {
    cumulative += sv[k] * sv[k];
    if (cumulative >= target) return static_cast<uint32_t>(k + 1);
  }
  return static_cast<uint32_t>(sv.size() + 1);
}

absl::Status ValidateAdaptiveRankConfig(const AdaptiveRankConfig& c) {
  if (c.window == 0) return absl::InvalidArgumentError("adaptive rank: window must be > 0");
  if (!(c.energy_fraction > 0 && c.energy_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: energy_fraction %f is outside (0, 1]", c.energy_fraction));
  }
  if (c.min_rank == 0 || c.min_rank > c.max_rank) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "adaptive rank: min_rank %d must be in [1, max_rank %d]", c.min_rank, c.max_rank));
  }
  if (c.initial_rank < c.min_rank || c.initial_rank > c.max_rank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: initial_rank %d is outside [min_rank %d, max_rank %d]",
                        c.initial_rank, c.min_rank, c.max_rank));
  }
  if (c.min_local_steps == 0 || c.min_local_steps > c.max_local_steps) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: min_local_steps %d must be in [1, max_local_steps %d]",
                        c.min_local_steps, c.max_local_steps));
  }
  if (c.initial_local_steps < c.min_local_steps || c.initial_local_steps > c.max_local_steps) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: initial_local_steps %d is outside [min_local_steps %d, "
                        "max_local_steps %d]",
                        c.initial_local_steps, c.min_local_steps, c.max_local_steps));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ObservedEffectiveRank(const LowRankFactors& factors, double total_energy,
                                               double energy_fraction) {
  ALOE_ASSIGN_OR_RETURN(std::vector<double> sv, LowRankSingularValues(factors));
  ALOE_ASSIGN_OR_RETURN(uint32_t energy_rank, EnergyRank(sv, total_energy, energy_fraction));
  // Beyond the factors' rank the spectrum is unseen: ask for twice the rank.
  return energy_rank > factors.rank ? 2 * factors.rank : energy_rank;
}

AdaptiveRank::AdaptiveRank(const AdaptiveRankConfig& config) : config_(config) {}

uint32_t AdaptiveRank::Clamp(uint32_t rank, const LayerState& layer) const {
  uint32_t upper = std::min(config_.max_rank, std::min(layer.rows, layer.cols));
  if (layer.rank_cap > 0) upper = std::min(upper, layer.rank_cap);
  return std::max<uint32_t>(1, std::min(std::max(rank, config_.min_rank), upper));
}

absl::StatusOr<uint32_t> AdaptiveRank::Observe(std::string_view layer,
                                               const LowRankFactors& factors, double total_energy) {
  ALOE_ASSIGN_OR_RETURN(uint32_t effective,
                        ObservedEffectiveRank(factors, total_energy, config_.energy_fraction));
  ALOE_RETURN_IF_ERROR(Record(layer, factors.rows, factors.cols, config_.initial_rank, effective));
  return effective;
}

absl::Status AdaptiveRank::CheckRecord(std::string_view layer, uint32_t rows, uint32_t cols,
                                       uint32_t initial_rank, uint32_t effective_rank) const {
  if (rows == 0 || cols == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: layer %s is %d x %d", layer, rows, cols));
  }
  const uint64_t most = 2 * static_cast<uint64_t>(std::min(rows, cols));
  if (effective_rank > most) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: effective rank %d of layer %s is outside [0, %d]",
                        effective_rank, layer, most));
  }
  if (initial_rank == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive rank: layer %s has initial rank 0", layer));
  }
  auto it = layers_.find(std::string(layer));
  if (it != layers_.end() && (it->second.rows != rows || it->second.cols != cols ||
                              it->second.initial_rank != initial_rank)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "adaptive rank: layer %s is %d x %d with initial rank %d, but was observed as %d x %d "
        "with initial rank %d",
        layer, rows, cols, initial_rank, it->second.rows, it->second.cols,
        it->second.initial_rank));
  }
  return absl::OkStatus();
}

absl::Status AdaptiveRank::Record(std::string_view layer, uint32_t rows, uint32_t cols,
                                  uint32_t initial_rank, uint32_t effective_rank,
                                  uint32_t rank_cap) {
  ALOE_RETURN_IF_ERROR(CheckRecord(layer, rows, cols, initial_rank, effective_rank));
  auto [it, inserted] = layers_.try_emplace(std::string(layer));
  LayerState& l = it->second;
  if (inserted) {
    l.name = std::string(layer);
    l.rows = rows;
    l.cols = cols;
    l.initial_rank = initial_rank;
    l.rank_cap = rank_cap;
  }
  l.recent.push_back(effective_rank);
  if (l.recent.size() > config_.window) l.recent.erase(l.recent.begin());
  return absl::OkStatus();
}

uint32_t AdaptiveRank::NextRank(std::string_view layer) const {
  auto it = layers_.find(std::string(layer));
  if (it == layers_.end()) return config_.initial_rank;
  const LayerState& l = it->second;
  uint64_t sum = 0;
  for (uint32_t r : l.recent) sum += r;
  const uint64_t n = l.recent.size();
  return Clamp(static_cast<uint32_t>((sum + n - 1) / n), l);
}

uint32_t AdaptiveRank::NextLocalSteps() const {
  uint64_t next_floats = 0;
  uint64_t initial_floats = 0;
  for (const auto& [name, l] : layers_) {
    const uint64_t width = static_cast<uint64_t>(l.rows) + l.cols;
    next_floats += width * NextRank(name);
    initial_floats += width * Clamp(l.initial_rank, l);
  }
  if (initial_floats == 0) return config_.initial_local_steps;
  // round(H_0 * next / initial), half up, in integers.
  const uint64_t h =
      (2 * static_cast<uint64_t>(config_.initial_local_steps) * next_floats + initial_floats) /
      (2 * initial_floats);
  return static_cast<uint32_t>(
      std::clamp<uint64_t>(h, config_.min_local_steps, config_.max_local_steps));
}

std::vector<AdaptiveRank::LayerState> AdaptiveRank::Save() const {
  std::vector<LayerState> out;
  out.reserve(layers_.size());
  for (const auto& [name, l] : layers_) out.push_back(l);
  std::sort(out.begin(), out.end(),
            [](const LayerState& a, const LayerState& b) { return a.name < b.name; });
  return out;
}

absl::Status AdaptiveRank::Restore(const std::vector<LayerState>& layers) {
  absl::flat_hash_map<std::string, LayerState> restored;
  AdaptiveRank check(config_);
  for (const LayerState& l : layers) {
    if (l.recent.empty() || l.recent.size() > config_.window) {
      return absl::InvalidArgumentError(
          absl::StrFormat("adaptive rank: layer %s has %d observations; the window is %d", l.name,
                          l.recent.size(), config_.window));
    }
    if (restored.contains(l.name)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("adaptive rank: layer %s appears twice", l.name));
    }
    for (uint32_t r : l.recent) {
      ALOE_RETURN_IF_ERROR(check.CheckRecord(l.name, l.rows, l.cols, l.initial_rank, r));
    }
    restored.emplace(l.name, l);
  }
  layers_ = std::move(restored);
  return absl::OkStatus();
}

}  // namespace aloe
