// Low-rank compression of 2-D pseudo-gradients (paper 001 Alg. 1, after PowerSGD) and the
// adaptive choice of rank and local steps (paper 001 Alg. 3). Pure math shared by the worker
// (compress, error feedback), the server (decode into staging memory) and the simulator: no
// wire format, no threads, no clock. The equations and their costs are in docs/algorithms.md,
// "Low-rank compression (paper 001)".
//
// Matrices are row-major float32. A rows x cols matrix M is approximated by P Q^T with P
// (rows x rank) having orthonormal columns and Q (cols x rank) = M^T P. Every function here is
// deterministic: the same inputs give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aloe {

// The factors of a rank-`rank` approximation M' = P Q^T. p is rows x rank and q is cols x rank,
// both row-major. q is also the warm start of the next round's compression of the same tensor.
struct LowRankFactors {
  uint32_t rows = 0;
  uint32_t cols = 0;
  uint32_t rank = 0;
  std::vector<float> p;
  std::vector<float> q;
};

// Floats the factors of a rows x cols tensor at `rank` occupy: (rows + cols) * rank.
uint64_t LowRankFactorFloats(uint32_t rows, uint32_t cols, uint32_t rank);

// One power iteration with warm start (paper 001 Alg. 1, PowerSGD): P = M Q0, P orthonormalised
// (modified Gram-Schmidt, twice), Q = M^T P. Q0 is warm_q (cols x rank, last round's q of this
// tensor) or, when warm_q is empty, a seeded pseudo-random matrix; its columns are scaled to unit
// norm first, which leaves the span of M Q0 as it is. Columns that vanish (M of rank below
// `rank`, or a zero M) are replaced by unit vectors orthogonal to the others, so P stays
// orthonormal and no NaN comes out. kInvalidArgument, naming the problem, when a dimension or
// rank is 0, rank > min(rows, cols), m.size() != rows * cols, warm_q.size() != cols * rank, m or
// warm_q holds NaN or Inf, or the products overflow float.
absl::StatusOr<LowRankFactors> CompressLowRank(absl::Span<const float> m, uint32_t rows,
                                               uint32_t cols, uint32_t rank,
                                               absl::Span<const float> warm_q, uint64_t seed);

// The seeded Q0 of CompressLowRank (cols x rank). Element (j, k) depends on seed, j and k only,
// so the init of rank r is the first r columns of the init of any higher rank.
std::vector<float> SeededLowRankInit(uint32_t cols, uint32_t rank, uint64_t seed);

// A warm start for a new rank: the first min(old, new) columns of q (cols x old_rank), then the
// seeded columns of SeededLowRankInit. kInvalidArgument when q.size() != cols * old_rank or
// new_rank is 0.
absl::StatusOr<std::vector<float>> ResizeWarmStart(absl::Span<const float> q, uint32_t cols,
                                                   uint32_t old_rank, uint32_t new_rank,
                                                   uint64_t seed);

// OK when the factors are well formed: dimensions and rank > 0, rank <= min(rows, cols), p and
// q of the sizes their shape implies, every value finite. Otherwise kInvalidArgument naming the
// problem. Every decoder below checks this first and writes nothing on error.
absl::Status ValidateLowRankFactors(const LowRankFactors& factors);

// out = P Q^T (rows * cols elements).
absl::Status DecompressLowRank(const LowRankFactors& factors, absl::Span<float> out);

// out[t] += scale * (P Q^T)[begin + t] for t < out.size(), in the row-major flat index of the
// rows x cols matrix: the server decodes a push range by range straight into its staging
// buffer; rows [a, b) are begin = a * cols, out.size() = (b - a) * cols. Each element is
// computed alone, so any split into ranges gives the same bits as one full decode.
// kInvalidArgument when the factors are malformed, scale is not finite, or the range ends
// past rows * cols.
absl::Status AccumulateLowRankRange(const LowRankFactors& factors, uint64_t begin, float scale,
                                    absl::Span<float> out);

// Streaming decode of a push whose Q arrives before P: Q is checked and transposed once, then
// P arrives in blocks of whole rows, each decoded straight into the staging rows it describes.
// Holds cols * rank floats. Gives the same bits as DecompressLowRank. Thread-compatible: const
// methods may run concurrently.
class LowRankRowDecoder {
 public:
  // kInvalidArgument for a bad shape (as CompressLowRank), q.size() != cols * rank, or a
  // non-finite value in q.
  static absl::StatusOr<LowRankRowDecoder> Create(absl::Span<const float> q, uint32_t rows,
                                                  uint32_t cols, uint32_t rank);

  // out += scale * P_rows Q^T, where p_rows holds rows [row_begin, row_begin + n) of P (n x
  // rank) and out the same rows of the matrix (n x cols). kInvalidArgument, with nothing
  // written, when p_rows is not whole rows, the rows end past `rows`, out has another size,
  // scale or a value of p_rows is not finite.
  absl::Status AccumulateRows(uint32_t row_begin, absl::Span<const float> p_rows, float scale,
                              absl::Span<float> out) const;

 private:
  LowRankRowDecoder() = default;
  uint32_t rows_ = 0;
  uint32_t cols_ = 0;
  uint32_t rank_ = 0;
  std::vector<float> qt_;  // Q transposed, rank x cols
};

// Error feedback: residual = M - P Q^T, which the worker keeps and adds to the next round's
// pseudo-gradient of this tensor. m and residual have rows * cols elements and may be the same
// buffer (in place). kInvalidArgument on malformed factors or sizes.
absl::Status LowRankResidual(absl::Span<const float> m, const LowRankFactors& factors,
                             absl::Span<float> residual);

// Singular values of a rows x cols matrix (row-major, double), descending, by one-sided Jacobi
// (Hestenes) rotations in double. Meant for small matrices: cost per sweep is about
// 6 min(rows, cols)^2 max(rows, cols) flops, and it takes 5 to 10 sweeps. kInvalidArgument
// for a size mismatch or a non-finite value.
absl::StatusOr<std::vector<double>> SingularValues(absl::Span<const double> a, size_t rows,
                                                   size_t cols);

// Singular values of P Q^T, descending. REQUIRES: P has orthonormal columns (CompressLowRank's
// P does); then they are those of Q, taken from the rank x rank Gram matrix Q^T Q.
absl::StatusOr<std::vector<double>> LowRankSingularValues(const LowRankFactors& factors);

// ||M||_F^2 in double.
double FrobeniusNormSquared(absl::Span<const float> m);

// Entropy effective rank (Roy and Vetterli): exp(-sum_i p_i ln p_i), p_i = s_i / sum_j s_j over
// the singular values s. 0 for an all-zero spectrum. Negative or non-finite values are
// kInvalidArgument.
absl::StatusOr<double> EntropyEffectiveRank(absl::Span<const double> singular_values);

// Energy rank: the smallest k with s_1^2 + ... + s_k^2 >= fraction * total_energy, where
// total_energy is ||M||_F^2 of the whole matrix and s are its leading singular values
// (descending). 0 when total_energy is 0. When the given values do not reach the fraction, the
// rank lies beyond them: returns singular_values.size() + 1. kInvalidArgument for fraction
// outside (0, 1] or a negative or non-finite input.
absl::StatusOr<uint32_t> EnergyRank(absl::Span<const double> singular_values, double total_energy,
                                    double fraction);

// Paper 001 Alg. 3: ranks adapted to the effective rank of the last `window` pseudo-gradients
// of each layer, and the local steps H adapted with them. Defaults follow paper 001 Sec. 4.1.3
// (window 5, H 125).
struct AdaptiveRankConfig {
  // Pseudo-gradients per layer whose effective ranks are averaged.
  uint32_t window = 5;
  // Share of ||M||_F^2 the effective rank keeps (EnergyRank).
  double energy_fraction = 0.9;
  // Rank of a layer before it has been observed (r_0), and the bounds of every rank.
  uint32_t initial_rank = 64;
  uint32_t min_rank = 1;
  uint32_t max_rank = 1024;
  // Local steps at the initial ranks (H_0), and the bounds of every H.
  uint32_t initial_local_steps = 125;
  uint32_t min_local_steps = 1;
  uint32_t max_local_steps = 100000;
};

// kInvalidArgument naming the first bad field: window 0, energy_fraction outside (0, 1],
// min_rank 0 or above max_rank, initial_rank outside [min_rank, max_rank], min_local_steps 0 or
// above max_local_steps, initial_local_steps outside [min_local_steps, max_local_steps].
absl::Status ValidateAdaptiveRankConfig(const AdaptiveRankConfig& config);

// The effective rank one compressed pseudo-gradient shows (paper 001 Alg. 3's observation): the
// energy rank (EnergyRank with energy_fraction) of the factors' spectrum, or twice the
// compression rank when the factors do not hold energy_fraction of ||M||_F^2 = total_energy (the
// rank lies beyond what they show). REQUIRES: P orthonormal (as CompressLowRank returns).
// kInvalidArgument for malformed factors, a negative or non-finite total_energy, or a fraction
// outside (0, 1].
absl::StatusOr<uint32_t> ObservedEffectiveRank(const LowRankFactors& factors, double total_energy,
                                               double energy_fraction);

// Per-layer rank and global H of paper 001 Alg. 3. Each observation is one effective rank
// (ObservedEffectiveRank). The next rank is the ceiling of the mean of the last `window` of them;
// the next H scales H_0 by the bytes of the next ranks over the bytes of the initial ranks, so
// that the transfer stays hidden behind the same share of local training. "Layer" here is one 2-D
// tensor, named by the caller. Not thread-safe; deterministic.
class AdaptiveRank {
 public:
  // What the class remembers of one layer: its shape, its initial rank r_0 and the window.
  struct LayerState {
    std::string name;
    uint32_t rows = 0;
    uint32_t cols = 0;
    uint32_t initial_rank = 0;
    // The greatest rank this layer may get (0: min(rows, cols)), e.g. the greatest at which its
    // factors are smaller than the layer.
    uint32_t rank_cap = 0;
    std::vector<uint32_t> recent;  // effective ranks, oldest first, at most `window`
  };

  // REQUIRES: ValidateAdaptiveRankConfig(config).ok().
  explicit AdaptiveRank(const AdaptiveRankConfig& config);

  // Records one pseudo-gradient of `layer`, compressed into `factors` (P orthonormal, as
  // CompressLowRank returns), whose full matrix had ||M||_F^2 = total_energy, with r_0 =
  // config.initial_rank. Returns the effective rank recorded. kInvalidArgument for malformed
  // factors, a negative or non-finite total_energy, or a layer whose shape differs from its
  // earlier observations.
  absl::StatusOr<uint32_t> Observe(std::string_view layer, const LowRankFactors& factors,
                                   double total_energy);

  // Records an effective rank measured elsewhere (a worker's PushHeader.observed_ranks) for the
  // rows x cols `layer` whose rank before any observation is initial_rank (r_0, clamped as
  // NextRank clamps). kInvalidArgument, with nothing recorded, for a zero dimension, an effective
  // rank above 2 min(rows, cols) (0 is a zero pseudo-gradient), or a shape or r_0 that differs from
  // the layer's earlier observations. rank_cap (0: none) bounds the layer's ranks, r_0 included,
  // beyond min(rows, cols).
  absl::Status Record(std::string_view layer, uint32_t rows, uint32_t cols, uint32_t initial_rank,
                      uint32_t effective_rank, uint32_t rank_cap = 0);
  // What Record would say, recording nothing.
  absl::Status CheckRecord(std::string_view layer, uint32_t rows, uint32_t cols,
                           uint32_t initial_rank, uint32_t effective_rank) const;

  // Whether `layer` has been observed (or restored).
  bool Knows(std::string_view layer) const { return layers_.contains(std::string(layer)); }

  // The rank for the layer's next compression: initial_rank before any observation (its shape
  // is not known yet, so the caller bounds it by min(rows, cols)), then the ceiling of the
  // window's mean, clamped to [min_rank, max_rank] and to min(rows, cols).
  uint32_t NextRank(std::string_view layer) const;

  // H for the next round: round(H_0 * sum_l (rows_l + cols_l) NextRank(l) /
  // sum_l (rows_l + cols_l) r0_l) over the observed layers, clamped to the configured bounds;
  // r0_l is the layer's initial rank clamped as NextRank clamps. H_0 before any observation.
  uint32_t NextLocalSteps() const;

  // The state of every observed layer, ordered by name, for checkpoints; and its restore, all or
  // nothing (kInvalidArgument naming the first bad layer: a zero dimension, an empty or too long
  // window, a rank out of range, a duplicate name).
  std::vector<LayerState> Save() const;
  absl::Status Restore(const std::vector<LayerState>& layers);

 private:
  uint32_t Clamp(uint32_t rank, const LayerState& layer) const;

  AdaptiveRankConfig config_;
  absl::flat_hash_map<std::string, LayerState> layers_;
};

}  // namespace aloe
