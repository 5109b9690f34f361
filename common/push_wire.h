// PushChunk messages (proto/aloe.proto) read and written without copying their payload, and
// ParamChunk messages written so. A push
// is almost all payload: protobuf would copy it into a std::string when the client builds the
// message, again when gRPC serialises it, and once more when the server parses it. Here the
// server parses the received message's slices in place (the data field stays a list of views
// into them) and the client frames a chunk as a few bytes of fields followed by the payload's
// own memory. The bytes on the wire are an ordinary serialised PushChunk, so either side works
// with a peer that uses the generated protobuf code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"

namespace aloe {

// The full names of ParameterService.Push and .Pull as gRPC calls them.
inline constexpr char kPushMethod[] = "/aloe.v1.ParameterService/Push";
inline constexpr char kPullMethod[] = "/aloe.v1.ParameterService/Pull";

// One parsed PushChunk. `data` views the message's own bytes: valid while they are.
struct PushChunkView {
  bool has_header = false;
  v1::PushHeader header;
  uint32_t layer_id = 0;
  uint64_t offset = 0;
  int32_t codec = 0;  // a v1::Codec value, possibly unknown (proto3 enums are open)
  std::vector<std::string_view> data;  // the data field, in pieces; empty pieces dropped
  size_t data_size = 0;
};

// Parses one serialised PushChunk that arrives as consecutive pieces (a gRPC message's slices).
// Field semantics are protobuf's: the last occurrence of a scalar or of `data` wins, repeated
// headers merge, a known field number with an unexpected wire type and unknown fields are
// skipped. Differences: unknown fields of the deprecated group wire types (3, 4) are refused,
// and so is anything protobuf refuses (truncated fields, varints over 10 bytes, field number 0,
// wire types 6 and 7, a malformed header). kInvalidArgument naming the problem; *out is then
// unspecified.
absl::Status ParsePushChunk(absl::Span<const std::string_view> pieces, PushChunkView* out);

// One parsed ParamChunk (a pulled chunk of parameters). `data` views the message's own bytes.
struct ParamChunkView {
  uint64_t version = 0;
  uint32_t layer_id = 0;
  uint64_t offset = 0;
  uint64_t layer_elements = 0;
  std::vector<std::string_view> data;  // the data field, in pieces; empty pieces dropped
  size_t data_size = 0;
  uint64_t group_version = 0;  // a pull by layer group: the group's version
};

// ParsePushChunk for a ParamChunk, with the same semantics and refusals.
absl::Status ParseParamChunk(absl::Span<const std::string_view> pieces, ParamChunkView* out);

// Calls run(bytes, out, n) over the float32 values that `pieces` hold, writing to `out` onward:
// each piece's whole values in place, a value split between pieces gathered first. Returns
// false as soon as run does, and when the bytes are not a whole number of values.
template <typename Run>
bool ForEachFloatRun(absl::Span<const std::string_view> pieces, float* out, Run run) {
  char split[sizeof(float)];
  size_t have = 0;  // bytes of a split value gathered so far
  for (std::string_view p : pieces) {
    if (have > 0) {
      const size_t take = std::min(sizeof(float) - have, p.size());
      std::memcpy(split + have, p.data(), take);
      have += take;
      p.remove_prefix(take);
      if (have < sizeof(float)) continue;
      if (!run(split, out++, size_t{1})) return false;
      have = 0;
    }
    const size_t n = p.size() / sizeof(float);
    if (!run(p.data(), out, n)) return false;
    out += n;
    p.remove_prefix(n * sizeof(float));
    std::memcpy(split, p.data(), p.size());
    have = p.size();
  }
  return have == 0;
}

// The serialised fields of a PushChunk up to and including the data field's tag and length:
// a message is these bytes followed by `data_size` payload bytes. Fields at their proto3
// default are left out, as protobuf does; header == nullptr: no header.
std::string PushChunkPrefix(const v1::PushHeader* header, uint32_t layer_id, uint64_t offset,
                            v1::Codec codec, size_t data_size);

// The serialised fields of a ParamChunk (a pulled chunk of parameters) up to and including the
// data field's tag and length, in field order: followed by the `data_size` payload bytes they are
// exactly protobuf's serialisation of the chunk. A group_version (field 6, pulls by layer group)
// goes before the data field, so that the payload still ends the message; protobuf parses fields
// in any order.
std::string ParamChunkPrefix(uint64_t version, uint32_t layer_id, uint64_t offset,
                             uint64_t layer_elements, size_t data_size, uint64_t group_version = 0);

}  // namespace aloe
