// EDiT pseudo-gradient penalty (paper 000 Sec. 3.2 and Alg. 2; docs/algorithms.md, "EDiT
// pseudo-gradient penalty"): before the outer optimizer steps a module (one layer of the
// ModelSpec), the pseudo-gradients of the updates aggregated together are screened and weighted
// by their norms, so that a worker that trained on bad data (a loss spike) cannot drag the global
// model with it. For module l and the set S of updates of one outer step (a sync round or an
// async grace batch, any size >= 1):
//
//   1. G_i = ||g_i^(l)||_2                                          (Alg. 2 line 2)
//   2. EMA z-test per (stream, module): z_i = (G_i - mu) / sigma; once the stream has `warmup`
//      norms in its statistics, z_i > delta marks update i anomalous: G_i := +inf (lines 3-5).
//      mu and sigma are then updated with every non-anomalous G (Eq. 1):
//        mu' = alpha*G + (1-alpha)*mu;  sigma' = sqrt((1-alpha)*sigma^2 + alpha*(G - mu')^2).
//   3. w_i = exp(-G_i/T) / sum_j exp(-G_j/T) (Eq. 2 with a temperature T; T = 1 is the paper),
//      computed as a shifted softmax (log-sum-exp), anomalous updates get exactly 0.
//   4. If every update is anomalous: rollback, nothing is applied to the module (lines 7-8).
//   5. g_bar = sum_i w_i g_i (Eq. 3); beta = min(phi / (||g_bar|| + 1e-6), 1) (Eq. 4);
//      g_hat = beta * g_bar (Eq. 5), which the module's outer optimizer applies (line 13).
// A single update gets weight 1 but is still tested and clipped.
//
// Choices the paper leaves open (see also the .cc):
//   - Stream: the statistics are kept per (stream, module) where stream is the pushing worker's id
//     (PendingUpdate::worker_id; paper: per worker W_i). Worker ids are never reused, so a worker
//     that rejoins starts a fresh warmup; ForgetStream drops a departed worker's statistics.
//   - Initialisation: a stream's first norm sets mu = G, sigma = 0 (atorch instead starts from
//     mu = sigma = 0, which leaves mu at 91% of a constant norm after its 120 warmup steps and
//     flags every later norm when the warmup is short; see the .cc).
//   - Warmup: the first `warmup` norms of a stream are never anomalous (atorch: count < warmup).
//   - sigma == 0 (all norms so far identical): z = 0, nothing to test against (as atorch).
//   - Several updates of one stream in S: all z-tests use the statistics from before S; the
//     non-anomalous norms are then folded in in the order of S.
//
// Not thread-safe as a whole, but each method touches only the state of the module it is given:
// calls for different modules may run concurrently (one apply group each), calls for the same
// module must be serialised. Pure: no threads, clock or I/O (docs/architecture.md, "Dependency
// rule").
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"
#include "server/core/layer_aggregation.h"
#include "server/core/update.h"

namespace aloe::server {

// The EMA statistics of one (stream, module): count = norms folded in so far.
struct PenaltyEmaStats {
  double mu = 0;
  double sigma = 0;
  uint64_t count = 0;
};

// What the penalty did with one update in one module.
struct PenaltyUpdateReport {
  uint64_t stream = 0;
  double norm = 0;         // G_i = ||g_i||_2 (finite; the +inf of an anomaly is not stored here)
  double z_score = 0;      // (G_i - mu)/sigma with the statistics before this step; 0 when the
                           // stream has no statistics yet or sigma == 0
  double weight = 0;       // w_i of Eq. 2; 0 when anomalous
  bool anomalous = false;  // past warmup and z_score > delta
};

// What the penalty did with one module in one outer step.
struct PenaltyModuleReport {
  std::vector<PenaltyUpdateReport> updates;  // in the order of S
  bool rollback = false;                     // every update anomalous: nothing applied
  double aggregated_norm = 0;                // ||g_bar|| before clipping; 0 on rollback
  double clip_coefficient = 0;               // beta of Eq. 4 in (0, 1]; 0 on rollback
};

class PseudoGradientPenalty {
 public:
  // Denominator guard of Eq. 4 (the paper's epsilon).
  static constexpr double kClipEpsilon = 1e-6;

  // For a model of num_modules modules. config as filled by FillServerDefaults; kInvalidArgument
  // (naming the field) unless it passes ValidatePenaltyConfig (common/config.h): ema_alpha in
  // (0, 1], z_threshold, temperature and clip_norm > 0 and finite. `enabled` is not looked at
  // (the caller decides whether to build one).
  static absl::StatusOr<std::unique_ptr<PseudoGradientPenalty>> Create(
      const v1::PenaltyConfig& config, size_t num_modules);

  // Steps 2-4 on given norms: the anomaly test, the EMA update with the non-anomalous norms and
  // the weights. streams[i] and norms[i] describe update i of S. Returns the report without
  // aggregated_norm/clip_coefficient (those need the buffers, see AggregateModule).
  // kInvalidArgument (state unchanged) for a module out of range, an empty S, sizes that differ,
  // or a norm that is negative or not finite.
  absl::StatusOr<PenaltyModuleReport> Weigh(size_t module, absl::Span<const uint64_t> streams,
                                            absl::Span<const double> norms);

  // The whole of Alg. 2 for one module on buffers: norms with kernels::SquaredL2Norm (one pass
  // per update), Weigh, out = sum_i w_i g_i (one kernels::WeightedAccumulate pass per update of
  // non-zero weight, a plain copy when one update has all the weight), the clip norm of out (one
  // pass) and, only when beta < 1, kernels::Scale. On rollback out is left unspecified and the
  // report says so. kInvalidArgument (state unchanged) as for Weigh, or when a buffer's size
  // differs from out's.
  absl::StatusOr<PenaltyModuleReport> AggregateModule(
      size_t module, absl::Span<const uint64_t> streams,
      absl::Span<const absl::Span<const float>> grads, absl::Span<float> out);

  // Eq. 4: min(phi / (aggregated_norm + 1e-6), 1).
  double ClipCoefficient(double aggregated_norm) const;

  // The statistics of (stream, module), if the stream has been seen in that module.
  std::optional<PenaltyEmaStats> Stats(size_t module, uint64_t stream) const;

  // Drops the statistics of `stream` in every module (the worker left for good). Must not run
  // concurrently with any other call.
  void ForgetStream(uint64_t stream);

  size_t num_modules() const { return modules_.size(); }
  const v1::PenaltyConfig& config() const { return config_; }

  // All EMA statistics for checkpoints: SaveState appends a self-describing binary blob (magic,
  // format version, module count, then per module its streams' id, count, mu, sigma);
  // hyperparameters are not included (they come from the config). LoadState replaces the state
  // with a blob's (kInvalidArgument, state unchanged, for another module count, a malformed or
  // truncated blob, trailing bytes, unsorted streams or negative/non-finite statistics).
  void SaveState(std::string* out) const;
  absl::Status LoadState(std::string_view blob);

  // The statistics of one module: stream -> statistics.
  using ModuleStats = std::map<uint64_t, PenaltyEmaStats>;
  // A SaveState blob's statistics, module by module, with LoadState's checks (but any module
  // count); and the blob of given statistics. With them a checkpoint converter moves modules
  // between the blobs of different process layouts.
  static absl::StatusOr<std::vector<ModuleStats>> ParseState(std::string_view blob);
  static void WriteState(const std::vector<ModuleStats>& modules, std::string* out);

 private:
  PseudoGradientPenalty(const v1::PenaltyConfig& config, size_t num_modules)
      : config_(config), modules_(num_modules) {}

  const v1::PenaltyConfig config_;
  // modules_[l]: stream -> statistics. The vector is never resized after construction, so
  // different modules can be updated from different threads.
  std::vector<ModuleStats> modules_;
};

// The penalty as the LayerAggregation of one outer step: stream = PendingUpdate::worker_id,
// module = layer index. Keeps each layer's report for metrics. Create one per outer step.
// Thread-safety as LayerAggregation: one layer per thread.
class PenaltyAggregation final : public LayerAggregation {
 public:
  // `penalty` must outlive this object.
  explicit PenaltyAggregation(PseudoGradientPenalty& penalty)
      : penalty_(penalty), reports_(penalty.num_modules()) {}

  absl::StatusOr<LayerStep> Aggregate(size_t layer, absl::Span<const PendingUpdate* const> updates,
                                      absl::Span<float> g) override;

  // reports()[layer]: that layer's report, empty updates when it was not aggregated.
  const std::vector<PenaltyModuleReport>& reports() const { return reports_; }

 private:
  PseudoGradientPenalty& penalty_;
  std::vector<PenaltyModuleReport> reports_;  // one slot per layer, written by its apply group only
};

}  // namespace aloe::server
