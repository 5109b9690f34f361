#include "common/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

void AppendFloats(absl::Span<const float> values, std::string* out) {
  const size_t old = out->size();
  out->resize(old + values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(out->data() + old, values.data(), values.size() * sizeof(float));
}

absl::Status DecodeFloats(std::string_view bytes, absl::Span<float> out) {
  if (bytes.size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("float32 payload of %d bytes is not a multiple of 4", bytes.size()));
  }
  if (bytes.size() / sizeof(float) != out.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "payload holds %d floats, expected %d", bytes.size() / sizeof(float), out.size()));
  }
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  if (!kernels::AllFinite(out.data(), out.size())) {
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) {
        return absl::InvalidArgumentError(
            absl::StrFormat("non-finite value %f at element %d", out[i], i));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<size_t, size_t>> ChunkRanges(size_t n, size_t max_elements) {
  std::vector<std::pair<size_t, size_t>> ranges;
  if (max_elements == 0) max_elements = 1;
  for (size_t b = 0; b < n; b += max_elements) ranges.emplace_back(b, std::min(n, b + max_elements));
  return ranges;
}

}  // namespace aloe
