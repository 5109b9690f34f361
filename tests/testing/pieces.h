// Byte strings cut into pieces, as gRPC hands over a received message's slices: shared by the
// tests and the fuzzer of the in-place push parsing (common/push_wire.h, UpdateAssembler).
// Header-only (the fuzz build compiles no test library).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace aloe::testing {

// `bytes` cut at the given positions (sorted, each in [0, bytes.size()]); repeated positions
// and the ends give empty pieces.
inline std::vector<std::string_view> CutAt(std::string_view bytes, const std::vector<size_t>& at) {
  std::vector<std::string_view> pieces;
  size_t from = 0;
  for (size_t a : at) {
    pieces.push_back(bytes.substr(from, a - from));
    from = a;
  }
  pieces.push_back(bytes.substr(from));
  return pieces;
}

inline std::string Joined(const std::vector<std::string_view>& pieces) {
  std::string out;
  for (std::string_view p : pieces) out.append(p);
  return out;
}

}  // namespace aloe::testing
