// The server's outer optimizers (ALGORITHMS.md "Outer optimizers"): given a pseudo-gradient
// g = theta_base - theta_end (already averaged over the updates of one step by the caller), they
// move the global parameters of one layer. One instance per layer, holding that layer's state
// (e.g. Nesterov momentum), so shards can step their layers independently.
//
// Extension points, deliberately not implemented yet: Delayed Nesterov (paper 002 Alg. 3) and
// Adam become further subclasses with their own state buffers and blob kinds; the staleness
// discount (paper 002 'Poly') scales g before Apply, so it needs no change to this interface.
#pragma once

#include <cstddef>
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
// Not thread-safe: the owning parameter shard serialises calls.
class OuterOptimizer {
 public:
  virtual ~OuterOptimizer() = default;

  // One outer step with pseudo-gradient g from theta_in to theta_out (theta_out may be
  // theta_in). kInvalidArgument when a size differs from num_elements, or when theta_out
  // partially overlaps an input; nothing is changed then.
  virtual absl::Status Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                             absl::Span<float> theta_out) = 0;

  // Short stable name of the algorithm ("sgd", "nesterov"); also the kind tag of the state blob.
  virtual std::string_view name() const = 0;

  // Optimizer state for checkpoints: SaveState appends a self-describing binary blob (kind,
  // element count, state buffers; hyperparameters are not included: they come from the config);
  // LoadState restores it (kInvalidArgument on a wrong size/kind or a malformed blob, state
  // unchanged). The blob must be passed back exactly, with no trailing bytes.
  virtual void SaveState(std::string* out) const = 0;
  virtual absl::Status LoadState(std::string_view blob) = 0;
};

// Validates `config` and builds the optimizer for one layer of num_elements floats:
//   OUTER_SGD: lr > 0 and finite (momentum is ignored);
//   OUTER_NESTEROV and OUTER_OPTIMIZER_UNSPECIFIED (= Nesterov): lr > 0 and finite,
//   momentum in [0, 1).
// Defaults (lr 0.7, momentum 0.9) are filled by the config loader before this is called, so a
// zero lr here is an error. kInvalidArgument naming the field ("outer_optimizer.lr ...") for a
// bad value or an unknown type.
absl::StatusOr<std::unique_ptr<OuterOptimizer>> MakeOuterOptimizer(
    const aloe::v1::OuterOptimizerConfig& config, size_t num_elements);

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

}  // namespace aloe::server
