#include "server/core/outer_optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/byte_io.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::server {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "state blobs are little-endian");

// State blob layout (little-endian, no padding):
//   char[4]  "AOOS" (ALOE outer optimizer state)
//   uint32   format version (kStateFormatVersion)
//   uint32   length of the kind name, then the name's bytes (OuterOptimizer::name())
//   uint64   num_elements
//   uint32   number of state buffers B
//   uint32   number of counters C (DN's update count t, Adam's step)
//   C x uint64 counters
//   B x num_elements float32
// Version 1 (no counter fields) was never written by a released build; it is not read.
constexpr char kStateMagic[4] = {'A', 'O', 'O', 'S'};
constexpr uint32_t kStateFormatVersion = 2;

void AppendState(std::string_view kind, size_t num_elements,
                 std::initializer_list<absl::Span<const float>> buffers,
                 std::initializer_list<uint64_t> counters, std::string* out) {
  out->append(kStateMagic, sizeof(kStateMagic));
  AppendPod<uint32_t>(kStateFormatVersion, out);
  AppendPod<uint32_t>(static_cast<uint32_t>(kind.size()), out);
  out->append(kind.data(), kind.size());
  AppendPod<uint64_t>(num_elements, out);
  AppendPod<uint32_t>(static_cast<uint32_t>(buffers.size()), out);
  AppendPod<uint32_t>(static_cast<uint32_t>(counters.size()), out);
  for (uint64_t counter : counters) AppendPod<uint64_t>(counter, out);
  for (absl::Span<const float> b : buffers) {
    out->append(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(float));
  }
}

// Validates a blob written by AppendState for `kind` with exactly `buffers.size()` buffers of
// num_elements finite floats each and `counters.size()` counters, and decodes them into
// `buffers` (resized) and `counters`. Callers pass temporaries: a failed load then leaves the
// optimizer unchanged.
absl::Status ParseState(std::string_view blob, std::string_view kind, size_t num_elements,
                        std::initializer_list<std::vector<float>*> buffers,
                        std::initializer_list<uint64_t*> counters) {
  std::string_view in = blob;
  char magic[sizeof(kStateMagic)];
  uint32_t version = 0;
  uint32_t kind_size = 0;
  if (!ReadPod(&in, &magic) || std::memcmp(magic, kStateMagic, sizeof(magic)) != 0) {
    return absl::InvalidArgumentError("outer optimizer state: not an optimizer state blob");
  }
  if (!ReadPod(&in, &version) || version != kStateFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer optimizer state: unsupported format version %d", version));
  }
  if (!ReadPod(&in, &kind_size) || in.size() < kind_size) {
    return absl::InvalidArgumentError("outer optimizer state: truncated kind");
  }
  const std::string_view blob_kind = in.substr(0, kind_size);
  in.remove_prefix(kind_size);
  if (blob_kind != kind) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "outer optimizer state: blob is for '%s', this optimizer is '%s'", blob_kind, kind));
  }
  uint64_t blob_elements = 0;
  uint32_t blob_buffers = 0;
  uint32_t blob_counters = 0;
  if (!ReadPod(&in, &blob_elements) || !ReadPod(&in, &blob_buffers) ||
      !ReadPod(&in, &blob_counters)) {
    return absl::InvalidArgumentError("outer optimizer state: truncated header");
  }
  if (blob_elements != num_elements) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer optimizer state: blob has %d elements, this layer has %d",
                        blob_elements, num_elements));
  }
  if (blob_buffers != buffers.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer optimizer state: blob has %d buffers, '%s' has %d", blob_buffers,
                        kind, buffers.size()));
  }
  if (blob_counters != counters.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer optimizer state: blob has %d counters, '%s' has %d", blob_counters,
                        kind, counters.size()));
  }
  for (uint64_t* counter : counters) {
    if (!ReadPod(&in, counter)) {
      return absl::InvalidArgumentError("outer optimizer state: truncated counters");
    }
  }
  const size_t buffer_bytes = num_elements * sizeof(float);
  if (in.size() != buffers.size() * buffer_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer optimizer state: %d payload bytes, expected %d", in.size(),
                        buffers.size() * buffer_bytes));
  }
  for (std::vector<float>* b : buffers) {
    b->resize(num_elements);
    if (buffer_bytes > 0) std::memcpy(b->data(), in.data(), buffer_bytes);
    in.remove_prefix(buffer_bytes);
    if (!kernels::AllFinite(b->data(), b->size())) {
      return absl::InvalidArgumentError("outer optimizer state: non-finite value in a buffer");
    }
  }
  return absl::OkStatus();
}

bool PartiallyOverlap(const float* a, size_t na, const float* b, size_t nb) {
  if (a == b || na == 0 || nb == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a);
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + nb * sizeof(float) && b0 < a0 + na * sizeof(float);
}

absl::Status CheckApplyArgs(std::string_view name, size_t num_elements, absl::Span<const float> g,
                            absl::Span<const float> theta_in, absl::Span<float> theta_out) {
  if (g.size() != num_elements || theta_in.size() != num_elements ||
      theta_out.size() != num_elements) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer %s: sizes g=%d theta_in=%d theta_out=%d, the layer has %d elements",
                        name, g.size(), theta_in.size(), theta_out.size(), num_elements));
  }
  if (PartiallyOverlap(theta_out.data(), theta_out.size(), theta_in.data(), theta_in.size()) ||
      PartiallyOverlap(theta_out.data(), theta_out.size(), g.data(), g.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "outer %s: theta_out partially overlaps an input (only exact in-place is allowed)", name));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<OuterOptimizer>> MakeOuterOptimizer(
    const aloe::v1::OuterOptimizerConfig& config, size_t num_elements) {
  // The loader's own check (common/config.h), so a config built in code meets the same ranges.
  ALOE_RETURN_IF_ERROR(ValidateOuterOptimizerConfig(config));
  const float lr = config.lr();
  switch (config.type()) {
    case aloe::v1::OUTER_SGD:
      return std::make_unique<OuterSgd>(num_elements, lr);
    case aloe::v1::OUTER_DELAYED_NESTEROV:
      return std::make_unique<OuterDelayedNesterov>(num_elements, lr, config.momentum(),
                                                    config.dn_buffer_size(),
                                                    config.dn_momentum_activation());
    case aloe::v1::OUTER_ADAM:
      return std::make_unique<OuterAdam>(num_elements, lr, config.adam_beta1(), config.adam_beta2(),
                                         config.adam_eps());
    default:  // OUTER_NESTEROV and OUTER_OPTIMIZER_UNSPECIFIED (the validation refused the rest)
      return std::make_unique<OuterNesterov>(num_elements, lr, config.momentum());
  }
}

absl::StatusOr<float> StalenessScale(const aloe::v1::OuterOptimizerConfig& config,
                                     uint64_t staleness) {
  ALOE_RETURN_IF_ERROR(ValidateStalenessExponent(config));
  const uint32_t max_staleness = config.max_staleness();
  if (max_staleness > 0 && staleness > max_staleness) {
    return absl::FailedPreconditionError(
        absl::StrFormat("update staleness %d exceeds max_staleness %d", staleness, max_staleness));
  }
  const float a = config.staleness_exponent();
  if (a == 0 || staleness == 0) return 1.0f;
  // 1 + staleness in double is exact up to 2^53 and merely rounds beyond: no overflow.
  return static_cast<float>(
      std::pow(1.0 + static_cast<double>(staleness), -static_cast<double>(a)));
}

absl::Status OuterSgd::Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                             absl::Span<float> theta_out) {
  ALOE_RETURN_IF_ERROR(CheckApplyArgs(name(), num_elements_, g, theta_in, theta_out));
  kernels::SgdApply(g.data(), theta_in.data(), theta_out.data(), num_elements_, lr_);
  return absl::OkStatus();
}

void OuterSgd::SaveState(std::string* out) const {
  AppendState(name(), num_elements_, {}, {}, out);
}

absl::Status OuterSgd::LoadState(std::string_view blob) {
  return ParseState(blob, name(), num_elements_, {}, {});
}

absl::Status OuterNesterov::Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                                  absl::Span<float> theta_out) {
  ALOE_RETURN_IF_ERROR(CheckApplyArgs(name(), momentum_.size(), g, theta_in, theta_out));
  kernels::NesterovApply(g.data(), momentum_.data(), theta_in.data(), theta_out.data(),
                         momentum_.size(), lr_, beta_);
  return absl::OkStatus();
}

void OuterNesterov::SaveState(std::string* out) const {
  AppendState(name(), momentum_.size(), {momentum_}, {}, out);
}

absl::Status OuterNesterov::LoadState(std::string_view blob) {
  std::vector<float> momentum;
  ALOE_RETURN_IF_ERROR(ParseState(blob, name(), momentum_.size(), {&momentum}, {}));
  momentum_ = std::move(momentum);
  return absl::OkStatus();
}

absl::Status OuterDelayedNesterov::Apply(absl::Span<const float> g,
                                         absl::Span<const float> theta_in,
                                         absl::Span<float> theta_out) {
  ALOE_RETURN_IF_ERROR(CheckApplyArgs(name(), momentum_.size(), g, theta_in, theta_out));
  const bool momentum_step = (num_updates_ + 1) % buffer_size_ == 0;
  kernels::DelayedNesterovApply(g.data(), momentum_.data(), buffer_.data(), theta_in.data(),
                                theta_out.data(), momentum_.size(), lr_, beta_, buffer_size_, c_,
                                momentum_step);
  ++num_updates_;
  return absl::OkStatus();
}

void OuterDelayedNesterov::SaveState(std::string* out) const {
  AppendState(name(), momentum_.size(), {momentum_, buffer_}, {num_updates_}, out);
}

absl::Status OuterDelayedNesterov::LoadState(std::string_view blob) {
  std::vector<float> momentum;
  std::vector<float> buffer;
  uint64_t num_updates = 0;
  ALOE_RETURN_IF_ERROR(
      ParseState(blob, name(), momentum_.size(), {&momentum, &buffer}, {&num_updates}));
  momentum_ = std::move(momentum);
  buffer_ = std::move(buffer);
  num_updates_ = num_updates;
  return absl::OkStatus();
}

absl::Status OuterAdam::Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                              absl::Span<float> theta_out) {
  ALOE_RETURN_IF_ERROR(CheckApplyArgs(name(), first_moment_.size(), g, theta_in, theta_out));
  const uint64_t t = step_ + 1;
  // 1 - beta^t in double: for beta2 = 0.999 and small t the float version loses digits.
  const double bias1 = 1.0 - std::pow(static_cast<double>(beta1_), static_cast<double>(t));
  const double bias2 = 1.0 - std::pow(static_cast<double>(beta2_), static_cast<double>(t));
  kernels::AdamApply(g.data(), first_moment_.data(), second_moment_.data(), theta_in.data(),
                     theta_out.data(), first_moment_.size(), static_cast<float>(lr_ / bias1),
                     beta1_, beta2_, eps_, static_cast<float>(1.0 / std::sqrt(bias2)));
  step_ = t;
  return absl::OkStatus();
}

void OuterAdam::SaveState(std::string* out) const {
  AppendState(name(), first_moment_.size(), {first_moment_, second_moment_}, {step_}, out);
}

absl::Status OuterAdam::LoadState(std::string_view blob) {
  std::vector<float> first_moment;
  std::vector<float> second_moment;
  uint64_t step = 0;
  ALOE_RETURN_IF_ERROR(
      ParseState(blob, name(), first_moment_.size(), {&first_moment, &second_moment}, {&step}));
  for (float v : second_moment) {
    if (v < 0) {
      return absl::InvalidArgumentError(
          "outer optimizer state: negative second moment in an 'adam' blob");
    }
  }
  first_moment_ = std::move(first_moment);
  second_moment_ = std::move(second_moment);
  step_ = step;
  return absl::OkStatus();
}

}  // namespace aloe::server
