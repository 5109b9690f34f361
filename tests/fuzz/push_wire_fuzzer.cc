// libFuzzer target for the push message parser (common/push_wire.h): the server parses every
// pushed PushChunk itself, straight from the received slices, so it must read exactly what
// protobuf reads. Built with ASan + UBSan (tests/fuzz/CMakeLists.txt).
//
// Input: u8 k, then k u16 cut positions (little-endian, each taken modulo the message size
// + 1, then sorted), then the bytes of one message, cut into k + 1 pieces at those positions
// (empty pieces included) as gRPC hands over a message's slices.
//
// Oracle, on every input (a violation aborts, which libFuzzer reports as a crash):
//   - Differential against protobuf's own parser on the joined bytes: when ParsePushChunk
//     accepts, protobuf accepts too and every field agrees (header byte for byte after
//     re-serialisation, layer id, offset, codec, data); when protobuf accepts, ParsePushChunk
//     accepts too unless the message holds an unknown group field (wire types 3/4), the one
//     thing it refuses on purpose. A refusal is kInvalidArgument naming a malformed message.
//   - The cut does not matter: the unsplit bytes parse to the same answer.
//   - Data views are non-empty and lie inside the input.
//   - Writing the parsed fields back with PushChunkPrefix + the data gives bytes protobuf
//     parses to the same fields.
//   - All of the above also for the same bytes read as a ParamChunk (ParseParamChunk,
//     ParamChunkPrefix), the message a pull streams.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "common/push_wire.h"
#include "google/protobuf/unknown_field_set.h"
#include "proto/aloe.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/testing/pieces.h"

namespace aloe {
namespace {

using ::aloe::testing::CutAt;
using ::aloe::testing::Joined;

bool HasUnknownGroup(const v1::PushChunk& chunk) {
  const google::protobuf::UnknownFieldSet& unknown = chunk.GetReflection()->GetUnknownFields(chunk);
  for (int i = 0; i < unknown.field_count(); ++i) {
    if (unknown.field(i).type() == google::protobuf::UnknownField::TYPE_GROUP) return true;
  }
  return false;
}

void CheckSame(const PushChunkView& view, const v1::PushChunk& chunk, const char* what) {
  FUZZ_CHECK(view.has_header == chunk.has_header(), "%s: has_header %d vs %d", what,
             view.has_header, chunk.has_header());
  FUZZ_CHECK(view.header.SerializeAsString() == chunk.header().SerializeAsString(),
             "%s: headers differ", what);
  FUZZ_CHECK(view.layer_id == chunk.layer_id(), "%s: layer %u vs %u", what, view.layer_id,
             chunk.layer_id());
  FUZZ_CHECK(view.offset == chunk.offset(), "%s: offset differs", what);
  FUZZ_CHECK(view.codec == static_cast<int32_t>(chunk.codec()), "%s: codec %d vs %d", what,
             view.codec, static_cast<int32_t>(chunk.codec()));
  FUZZ_CHECK(view.data_size == chunk.data().size() && Joined(view.data) == chunk.data(),
             "%s: data differs (%zu vs %zu bytes)", what, view.data_size, chunk.data().size());
}

// The same bytes read as a ParamChunk (ParseParamChunk), against protobuf's ParamChunk.
void CheckParamChunk(const std::vector<std::string_view>& pieces, std::string_view message) {
  ParamChunkView view;
  const absl::Status parsed = ParseParamChunk(pieces, &view);
  v1::ParamChunk chunk;
  const bool protobuf_ok = chunk.ParseFromArray(message.data(), static_cast<int>(message.size()));
  if (!parsed.ok()) {
    bool group = false;
    if (protobuf_ok) {
      const google::protobuf::UnknownFieldSet& unknown =
          chunk.GetReflection()->GetUnknownFields(chunk);
      for (int i = 0; i < unknown.field_count(); ++i) {
        group |= unknown.field(i).type() == google::protobuf::UnknownField::TYPE_GROUP;
      }
    }
    FUZZ_CHECK(!protobuf_ok || group, "protobuf reads the ParamChunk, ParseParamChunk refuses: %s",
               parsed.ToString().c_str());
    return;
  }
  FUZZ_CHECK(protobuf_ok, "ParseParamChunk reads a message protobuf refuses");
  FUZZ_CHECK(view.version == chunk.version() && view.layer_id == chunk.layer_id() &&
                 view.offset == chunk.offset() && view.layer_elements == chunk.layer_elements(),
             "ParamChunk fields differ");
  FUZZ_CHECK(view.data_size == chunk.data().size() && Joined(view.data) == chunk.data(),
             "ParamChunk data differs");
  const std::string rewritten = ParamChunkPrefix(view.version, view.layer_id, view.offset,
                                                 view.layer_elements, view.data_size) +
                                Joined(view.data);
  v1::ParamChunk back;
  FUZZ_CHECK(back.ParseFromString(rewritten) && back.version() == chunk.version() &&
                 back.layer_id() == chunk.layer_id() && back.offset() == chunk.offset() &&
                 back.layer_elements() == chunk.layer_elements() && back.data() == chunk.data(),
             "ParamChunkPrefix + data does not read back");
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const size_t k = data[0] % 8;
  size_t pos = 1;
  std::vector<uint16_t> raw_cuts;
  for (size_t i = 0; i < k && pos + 2 <= size; ++i, pos += 2) {
    uint16_t c;
    std::memcpy(&c, data + pos, 2);
    raw_cuts.push_back(c);
  }
  const std::string_view message(reinterpret_cast<const char*>(data) + std::min(pos, size),
                                 size - std::min(pos, size));
  std::vector<size_t> cuts;
  for (uint16_t c : raw_cuts) cuts.push_back(c % (message.size() + 1));
  std::sort(cuts.begin(), cuts.end());
  const std::vector<std::string_view> pieces = CutAt(message, cuts);

  PushChunkView view;
  const absl::Status parsed = ParsePushChunk(pieces, &view);
  v1::PushChunk chunk;
  const bool protobuf_ok = chunk.ParseFromArray(message.data(), static_cast<int>(message.size()));

  PushChunkView whole;
  const std::string_view one[] = {message};
  const absl::Status parsed_whole = ParsePushChunk(one, &whole);
  FUZZ_CHECK(parsed.ok() == parsed_whole.ok(), "cut changes the answer: %s vs %s",
             parsed.ToString().c_str(), parsed_whole.ToString().c_str());

  if (!parsed.ok()) {
    CheckParamChunk(pieces, message);
    FUZZ_CHECK(parsed.code() == absl::StatusCode::kInvalidArgument &&
                   absl::StrContains(parsed.message(), "malformed push message"),
               "refusal: %s", parsed.ToString().c_str());
    FUZZ_CHECK(!protobuf_ok || HasUnknownGroup(chunk),
               "protobuf reads the message, ParsePushChunk refuses it: %s",
               parsed.ToString().c_str());
    return;
  }
  FUZZ_CHECK(protobuf_ok, "ParsePushChunk reads a message protobuf refuses");
  CheckSame(view, chunk, "cut");
  CheckSame(whole, chunk, "whole");
  for (std::string_view d : view.data) {
    FUZZ_CHECK(!d.empty() && d.data() >= message.data() &&
                   d.data() + d.size() <= message.data() + message.size(),
               "a data view outside the message");
  }

  CheckParamChunk(pieces, message);

  const std::string rewritten =
      PushChunkPrefix(view.has_header ? &view.header : nullptr, view.layer_id, view.offset,
                      static_cast<v1::Codec>(view.codec), view.data_size) +
      Joined(view.data);
  v1::PushChunk back;
  FUZZ_CHECK(back.ParseFromString(rewritten), "protobuf refuses PushChunkPrefix + data");
  if (!view.has_header) FUZZ_CHECK(!back.has_header(), "a header appeared");
  CheckSame(view, back, "rewritten");
}

}  // namespace
}  // namespace aloe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  aloe::Run(data, size);
  return 0;
}
