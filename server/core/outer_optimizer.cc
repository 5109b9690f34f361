#include "server/core/outer_optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_format.h"
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
//   B x num_elements float32
constexpr char kStateMagic[4] = {'A', 'O', 'O', 'S'};
constexpr uint32_t kStateFormatVersion = 1;

template <typename T>
void AppendPod(T value, std::string* out) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void AppendState(std::string_view kind, size_t num_elements,
                 std::initializer_list<absl::Span<const float>> buffers, std::string* out) {
  out->append(kStateMagic, sizeof(kStateMagic));
  AppendPod<uint32_t>(kStateFormatVersion, out);
  AppendPod<uint32_t>(static_cast<uint32_t>(kind.size()), out);
  out->append(kind.data(), kind.size());
  AppendPod<uint64_t>(num_elements, out);
  AppendPod<uint32_t>(static_cast<uint32_t>(buffers.size()), out);
  for (absl::Span<const float> b : buffers) {
    out->append(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(float));
  }
}

// Reads a T from the front of *in and advances it; false when too short.
template <typename T>
bool ReadPod(std::string_view* in, T* value) {
  if (in->size() < sizeof(T)) return false;
  std::memcpy(value, in->data(), sizeof(T));
  in->remove_prefix(sizeof(T));
  return true;
}

// Validates a blob written by AppendState for `kind` with exactly `buffers.size()` buffers of
// num_elements finite floats each, and decodes them into `buffers` (resized). Touches no
// optimizer state, so a failed load leaves the optimizer unchanged.
absl::Status ParseState(std::string_view blob, std::string_view kind, size_t num_elements,
                        std::initializer_list<std::vector<float>*> buffers) {
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
  if (!ReadPod(&in, &blob_elements) || !ReadPod(&in, &blob_buffers)) {
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
  const float lr = config.lr();
  if (!(lr > 0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer_optimizer.lr must be > 0 and finite, got %g", lr));
  }
  switch (config.type()) {
    case aloe::v1::OUTER_SGD:
      return std::make_unique<OuterSgd>(num_elements, lr);
    case aloe::v1::OUTER_OPTIMIZER_UNSPECIFIED:
    case aloe::v1::OUTER_NESTEROV: {
      const float beta = config.momentum();
      if (!(beta >= 0 && beta < 1)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("outer_optimizer.momentum must be in [0, 1), got %g", beta));
      }
      return std::make_unique<OuterNesterov>(num_elements, lr, beta);
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("outer_optimizer.type %d is not a known outer optimizer", config.type()));
  }
}

absl::Status OuterSgd::Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                             absl::Span<float> theta_out) {
  ALOE_RETURN_IF_ERROR(CheckApplyArgs(name(), num_elements_, g, theta_in, theta_out));
  kernels::SgdApply(g.data(), theta_in.data(), theta_out.data(), num_elements_, lr_);
  return absl::OkStatus();
}

void OuterSgd::SaveState(std::string* out) const { AppendState(name(), num_elements_, {}, out); }

absl::Status OuterSgd::LoadState(std::string_view blob) {
  return ParseState(blob, name(), num_elements_, {});
}

absl::Status OuterNesterov::Apply(absl::Span<const float> g, absl::Span<const float> theta_in,
                                  absl::Span<float> theta_out) {
  ALOE_RETURN_IF_ERROR(CheckApplyArgs(name(), momentum_.size(), g, theta_in, theta_out));
  kernels::NesterovApply(g.data(), momentum_.data(), theta_in.data(), theta_out.data(),
                         momentum_.size(), lr_, beta_);
  return absl::OkStatus();
}

void OuterNesterov::SaveState(std::string* out) const {
  AppendState(name(), momentum_.size(), {momentum_}, out);
}

absl::Status OuterNesterov::LoadState(std::string_view blob) {
  std::vector<float> momentum;
  ALOE_RETURN_IF_ERROR(ParseState(blob, name(), momentum_.size(), {&momentum}));
  momentum_ = std::move(momentum);
  return absl::OkStatus();
}

}  // namespace aloe::server
