// The server's outer optimizers (docs/algorithms.md, "Outer optimizers"): given a pseudo-gradient
// g = theta_base - theta_end, they move the global parameters of one layer. One instance per
// layer, holding that layer's state (e.g. Nesterov momentum), so apply groups and shard
// processes can step their layers independently. What one Apply call consumes is the caller's
// choice: the average of a sync round (SGD, Nesterov, Adam) or one worker's update (Delayed
// Nesterov counts calls, Alg. 3).
//
// The staleness discount (paper 002 'Poly') and threshold ('PolyThres') are not optimizer state:
// StalenessScale below is a pure function of the config and an update's staleness, applied by
// the caller to each update before it is aggregated, so it needs no change to this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// One optimizer instance per layer (flat float buffer of num_elements); holds that layer's state.
// Not thread-safe: the owning apply group serialises calls.
class OuterOptimizer {
 public:
  virtual ~OuterOptimizer() = default;

  // One outer step with pseudo-gradient g from theta_in to theta_out (theta_out may be
  // theta_in). kInvalidArgument when a size differs from num_elements, or when theta_out
  // partially overlaps an input; nothing is changed then.
  virtual absl::Status Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                             absl::Span<float> theta_out) = 0;

  // Short stable name of the algorithm ("sgd", "nesterov", "delayed_nesterov", "adam"); also the
  // kind tag of the state blob.
  virtual std::string_view name() const = 0;

  // Optimizer state for checkpoints: SaveState appends a self-describing binary blob (kind,
  // element count, step counters, state buffers; hyperparameters are not included: they come
  // from the config);
  // LoadState restores it (kInvalidArgument on a wrong size/kind or a malformed blob, state
  // unchanged). The blob must be passed back exactly, with no trailing bytes.
  virtual void SaveState(std::string* out) const = 0;
  virtual absl::Status LoadState(std::string_view blob) = 0;
};

// Validates `config` with ValidateOuterOptimizerConfig (common/config.h: the ranges the config
// loader enforces, for the fields config.type() reads) and builds the optimizer for one layer of
// num_elements floats; OUTER_OPTIMIZER_UNSPECIFIED builds Nesterov. Defaults (lr 0.7, momentum
// 0.9, N 1, Adam 0.9/0.999/1e-8) are filled by the config loader before this is called, so a
// zero lr, N or eps here is an error. kInvalidArgument naming the field ("outer_optimizer.lr
// ...", "outer_optimizer.dn_buffer_size ...") for a bad value or an unknown type.
absl::StatusOr<std::unique_ptr<OuterOptimizer>> MakeOuterOptimizer(
    const aloe::v1::OuterOptimizerConfig& config, size_t num_elements);

// Staleness policy for one update (paper 002 Sec. 4 'Poly' and 'PolyThres', after Xie et al.
// 2019), with staleness = (server version when the update is applied) - (version it started
// from); a pure function, called by the server for each update before aggregating it:
//   - max_staleness M > 0 and staleness > M: the update must be dropped; returns
//     kFailedPrecondition "update staleness S exceeds max_staleness M" (staleness == M is kept);
//   - otherwise the factor the update's pseudo-gradient is multiplied by:
//     (1 + staleness)^(-a) with a = staleness_exponent, exactly 1 when a == 0 (off, the default)
//     or staleness == 0; computed in double, rounded to float once.
// kInvalidArgument "outer_optimizer.staleness_exponent ..." when a is negative or not finite
// (ValidateStalenessExponent).
absl::StatusOr<float> StalenessScale(const aloe::v1::OuterOptimizerConfig& config,
                                     uint64_t staleness);

// Outer SGD: theta -= lr * g. Stateless (its blob carries only the kind and size).
class OuterSgd final : public OuterOptimizer {
 public:
  // Precondition: lr > 0 and finite (MakeOuterOptimizer checks it).
  OuterSgd(size_t num_elements, float lr) : num_elements_(num_elements), lr_(lr) {}

  absl::Status Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                     absl::Span<float> theta_out) override;
  std::string_view name() const override { return "sgd"; }
  void SaveState(std::string* out) const override;
  absl::Status LoadState(std::string_view blob) override;

 private:
  const size_t num_elements_;
  const float lr_;
};

// DiLoCo's outer Nesterov momentum, paper 002 Eq. 4:
//   m = beta * m + g;  theta -= lr * (beta * m + g),  with m = 0 initially.
// Applied sequentially to k identical g it gives m_k = (1 + beta + ... + beta^(k-1)) g
// (paper 002 Eq. 5), the reason naive asynchronous application overshoots.
class OuterNesterov final : public OuterOptimizer {
 public:
  // Precondition: lr > 0 and finite, beta in [0, 1) (MakeOuterOptimizer checks them).
  OuterNesterov(size_t num_elements, float lr, float beta)
      : lr_(lr), beta_(beta), momentum_(num_elements, 0.0f) {}

  absl::Status Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                     absl::Span<float> theta_out) override;
  std::string_view name() const override { return "nesterov"; }
  void SaveState(std::string* out) const override;
  absl::Status LoadState(std::string_view blob) override;

  // The momentum buffer m (for tests and metrics).
  absl::Span<const float> momentum() const { return momentum_; }

 private:
  const float lr_;
  const float beta_;
  std::vector<float> momentum_;
};

// Delayed Nesterov, DN (paper 002 Alg. 3): pseudo-gradients are summed in a buffer D and the
// Nesterov momentum is updated only on every N-th call; in between, plain SGD steps of g/N plus
// an optional fraction c of the old momentum. Per call, with t = num_updates() before it:
//   D += g
//   (t+1) % N == 0:  m = beta*m + D/N;  theta -= lr*((1 - c*N + c)*beta*m + g/N);  D = 0
//   otherwise:       theta -= lr*(c*beta*m + g/N)
//   t += 1
// m = D = 0 and t = 0 initially. Each Apply is one server update (one worker's pseudo-gradient,
// possibly staleness-scaled); N is usually the number of workers.
// Checks (tests/unit/server/outer_optimizer_test.cc): N = 1, c = 0 is bit for bit OuterNesterov
// (N = 1 with any c is Nesterov up to float rounding). With c = 0 and D = 0 at the start of a
// buffer period, its N calls leave theta and m where one OuterNesterov step on the average of
// their N pseudo-gradients would (up to float rounding; the intermediate thetas are SGD steps of
// g_i/N); with c > 0 the final theta differs by lr*beta*c*(N-1)*(m_new - m_old).
// State blob: counter t, buffers m and D. If N changes across a checkpoint, the restored D is
// flushed at the next multiple of the new N.
class OuterDelayedNesterov final : public OuterOptimizer {
 public:
  // Precondition: lr > 0 and finite, beta in [0, 1), buffer_size >= 1, c in [0, 1/buffer_size]
  // (MakeOuterOptimizer checks them).
  OuterDelayedNesterov(size_t num_elements, float lr, float beta, uint32_t buffer_size, float c)
      : lr_(lr),
        beta_(beta),
        buffer_size_(buffer_size),
        c_(c),
        momentum_(num_elements, 0.0f),
        buffer_(num_elements, 0.0f) {}

  absl::Status Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                     absl::Span<float> theta_out) override;
  std::string_view name() const override { return "delayed_nesterov"; }
  void SaveState(std::string* out) const override;
  absl::Status LoadState(std::string_view blob) override;

  // The momentum m, the buffer D (sum of the pseudo-gradients since the last momentum step) and
  // the count t of applied updates (for tests and metrics).
  absl::Span<const float> momentum() const { return momentum_; }
  absl::Span<const float> buffer() const { return buffer_; }
  uint64_t num_updates() const { return num_updates_; }

 private:
  const float lr_;
  const float beta_;
  const uint32_t buffer_size_;
  const float c_;
  std::vector<float> momentum_;
  std::vector<float> buffer_;
  uint64_t num_updates_ = 0;
};

// Outer Adam (Kingma & Ba 2015, Alg. 1; no weight decay), for comparison with the Nesterov
// family. Per call, with step t counted from 1:
//   m = beta1*m + (1 - beta1)*g;  v = beta2*v + (1 - beta2)*g^2
//   theta -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// m = v = 0 and t = 0 initially; bias corrections in double, rounded to float once per call.
// State blob: step t, buffers m and v (v must be >= 0).
class OuterAdam final : public OuterOptimizer {
 public:
  // Precondition: lr > 0 and finite, beta1 and beta2 in [0, 1), eps > 0 and finite
  // (MakeOuterOptimizer checks them).
  OuterAdam(size_t num_elements, float lr, float beta1, float beta2, float eps)
      : lr_(lr),
        beta1_(beta1),
        beta2_(beta2),
        eps_(eps),
        first_moment_(num_elements, 0.0f),
        second_moment_(num_elements, 0.0f) {}

  absl::Status Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                     absl::Span<float> theta_out) override;
  std::string_view name() const override { return "adam"; }
  void SaveState(std::string* out) const override;
  absl::Status LoadState(std::string_view blob) override;

  // m, v and the number of steps taken (for tests and metrics).
  absl::Span<const float> first_moment() const { return first_moment_; }
  absl::Span<const float> second_moment() const { return second_moment_; }
  uint64_t step() const { return step_; }

 private:
  const float lr_;
  const float beta1_;
  const float beta2_;
  const float eps_;
  std::vector<float> first_moment_;
  std::vector<float> second_moment_;
  uint64_t step_ = 0;
};

}  // namespace aloe::server
