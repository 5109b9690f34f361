#include "common/push_wire.h"

#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/aloe.pb.h"
#include "tests/testing/pieces.h"

namespace aloe {
namespace {

using ::testing::HasSubstr;

v1::PushHeader SomeHeader() {
  v1::PushHeader h;
  h.set_worker_id(77);
  h.set_task_id(123456789012ull);
  h.set_update_id(3);
  h.set_base_version(41);
  h.set_steps_done(20);
  h.set_train_loss(2.5);
  h.set_codec(v1::CODEC_BF16);
  h.set_slice(1);
  h.set_slices(4);
  return h;
}

using ::aloe::testing::CutAt;
using ::aloe::testing::Joined;

TEST(PushWireTest, MethodNameIsTheGeneratedOne) {
  const google::protobuf::MethodDescriptor* push =
      google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
          "aloe.v1.ParameterService.Push");
  ASSERT_NE(push, nullptr);
  EXPECT_EQ(std::string(kPushMethod), "/" + push->service()->full_name() + "/" + push->name());
  EXPECT_EQ(std::string(kPullMethod), "/" + push->service()->full_name() + "/Pull");
  EXPECT_NE(push->service()->FindMethodByName("Pull"), nullptr);
}

TEST(PushWireTest, ParsesWhatProtobufSerialisesCutAnywhere) {
  std::mt19937 rng(20261124);
  for (int trial = 0; trial < 200; ++trial) {
    v1::PushChunk chunk;
    if (trial % 3 == 0) *chunk.mutable_header() = SomeHeader();
    chunk.set_layer_id(trial % 5 == 0 ? 0 : rng());
    chunk.set_offset(trial % 7 == 0 ? 0 : (uint64_t{rng()} << 20) | rng());
    chunk.set_codec(static_cast<v1::Codec>(trial % 4 == 3 ? -5 : trial % 4));
    std::string data(rng() % 3000, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    chunk.set_data(data);
    const std::string bytes = chunk.SerializeAsString();
    std::vector<size_t> at;
    for (int i = rng() % 5; i > 0; --i) at.push_back(rng() % (bytes.size() + 1));
    std::sort(at.begin(), at.end());

    PushChunkView view;
    ASSERT_TRUE(ParsePushChunk(CutAt(bytes, at), &view).ok()) << trial;
    EXPECT_EQ(view.has_header, chunk.has_header());
    if (chunk.has_header()) {
      EXPECT_EQ(view.header.SerializeAsString(), chunk.header().SerializeAsString());
    }
    EXPECT_EQ(view.layer_id, chunk.layer_id());
    EXPECT_EQ(view.offset, chunk.offset());
    EXPECT_EQ(view.codec, static_cast<int32_t>(chunk.codec()));
    EXPECT_EQ(view.data_size, data.size());
    EXPECT_EQ(Joined(view.data), data) << trial;
    for (std::string_view p : view.data) EXPECT_FALSE(p.empty());
  }
}

TEST(PushWireTest, PrefixPlusPayloadIsAPushChunkProtobufReads) {
  const v1::PushHeader header = SomeHeader();
  const std::string payload = "\x01\x02\x03\x04\x05\x06\x07\x08";
  for (const v1::PushHeader* h : {&header, static_cast<const v1::PushHeader*>(nullptr)}) {
    const std::string bytes =
        PushChunkPrefix(h, 300, uint64_t{1} << 40, v1::CODEC_INT8_BLOCKWISE, payload.size()) +
        payload;
    v1::PushChunk chunk;
    ASSERT_TRUE(chunk.ParseFromString(bytes));
    EXPECT_EQ(chunk.has_header(), h != nullptr);
    if (h != nullptr) {
      EXPECT_EQ(chunk.header().SerializeAsString(), h->SerializeAsString());
    }
    EXPECT_EQ(chunk.layer_id(), 300u);
    EXPECT_EQ(chunk.offset(), uint64_t{1} << 40);
    EXPECT_EQ(chunk.codec(), v1::CODEC_INT8_BLOCKWISE);
    EXPECT_EQ(chunk.data(), payload);
  }
  // Defaults are left out as protobuf leaves them out: the same bytes. Negative enum values are
  // sign-extended to ten bytes, as protobuf writes them.
  v1::PushChunk only_data;
  only_data.set_data(payload);
  EXPECT_EQ(PushChunkPrefix(nullptr, 0, 0, v1::CODEC_UNSPECIFIED, payload.size()) + payload,
            only_data.SerializeAsString());
  v1::PushChunk negative;
  negative.set_codec(static_cast<v1::Codec>(-1));
  EXPECT_EQ(PushChunkPrefix(nullptr, 0, 0, static_cast<v1::Codec>(-1), 0),
            negative.SerializeAsString());
  EXPECT_EQ(PushChunkPrefix(nullptr, 0, 0, v1::CODEC_UNSPECIFIED, 0), "");
}

TEST(PushWireTest, FollowsProtobufFieldSemantics) {
  // The last data and scalar win, headers merge, unknown fields and known fields with another
  // wire type are skipped.
  v1::PushChunk a;
  a.mutable_header()->set_worker_id(5);
  a.set_layer_id(1);
  a.set_data("first");
  v1::PushChunk b;
  b.mutable_header()->set_task_id(9);
  b.set_layer_id(2);
  b.set_data("second");
  std::string bytes = a.SerializeAsString() + b.SerializeAsString();
  bytes += std::string("\x98\x06\x07", 3);          // field 99, varint 7
  bytes += std::string("\x15\x01\x02\x03\x04", 5);  // field 2 as fixed32: not layer_id
  bytes += std::string("\x29\0\0\0\0\0\0\0\0", 9);  // field 5 as fixed64: not codec
  bytes += std::string("\xa2\x06\x03xyz", 6);       // field 100, 3 bytes
  v1::PushChunk merged;
  ASSERT_TRUE(merged.ParseFromString(bytes));
  PushChunkView view;
  ASSERT_TRUE(ParsePushChunk({bytes}, &view).ok());
  EXPECT_EQ(view.header.worker_id(), 5u);
  EXPECT_EQ(view.header.task_id(), 9u);
  EXPECT_EQ(view.header.SerializeAsString(), merged.header().SerializeAsString());
  EXPECT_EQ(view.layer_id, 2u);
  EXPECT_EQ(Joined(view.data), "second");
  EXPECT_EQ(merged.data(), "second");
  EXPECT_EQ(view.codec, 0);
}

TEST(PushWireTest, ParamChunkPrefixPlusPayloadIsProtobufsSerialisation) {
  const std::string payload(4 * 300, '\x3f');
  for (uint64_t version : {uint64_t{0}, uint64_t{7}, uint64_t{1} << 50}) {
    for (uint32_t layer : {0u, 3u, 70000u}) {
      for (uint64_t offset : {uint64_t{0}, uint64_t{262144}}) {
        for (size_t size : {size_t{0}, payload.size()}) {
          v1::ParamChunk chunk;
          chunk.set_version(version);
          chunk.set_layer_id(layer);
          chunk.set_offset(offset);
          chunk.set_layer_elements(offset + 300);
          chunk.set_data(payload.substr(0, size));
          EXPECT_EQ(ParamChunkPrefix(version, layer, offset, offset + 300, size) +
                        payload.substr(0, size),
                    chunk.SerializeAsString())
              << version << " " << layer << " " << offset << " " << size;
        }
      }
    }
  }
}

TEST(PushWireTest, ParamChunkWithAGroupVersionParsesAsProtobufAndAsAView) {
  const std::string payload(4 * 3, '\x3f');
  const std::string bytes = ParamChunkPrefix(9, 2, 0, 3, payload.size(), 41) + payload;
  v1::ParamChunk chunk;
  ASSERT_TRUE(chunk.ParseFromString(bytes));
  EXPECT_EQ(chunk.version(), 9u);
  EXPECT_EQ(chunk.layer_id(), 2u);
  EXPECT_EQ(chunk.group_version(), 41u);
  EXPECT_EQ(chunk.data(), payload);
  ParamChunkView view;
  ASSERT_TRUE(ParseParamChunk({bytes}, &view).ok());
  EXPECT_EQ(view.group_version, 41u);
  EXPECT_EQ(view.version, 9u);
  EXPECT_EQ(Joined(view.data), payload);
}

TEST(PushWireTest, ParsesParamChunksCutAnywhere) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 100; ++trial) {
    v1::ParamChunk chunk;
    chunk.set_version(trial % 3 == 0 ? 0 : rng());
    chunk.set_layer_id(trial % 4 == 0 ? 0 : rng());
    chunk.set_offset(trial % 5 == 0 ? 0 : (uint64_t{rng()} << 12));
    chunk.set_layer_elements(rng());
    if (trial % 3 == 1) chunk.set_group_version(rng());
    std::string data(rng() % 2000, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    chunk.set_data(data);
    std::string bytes = chunk.SerializeAsString();
    if (trial % 2 == 1) bytes += std::string("\x40\x05\x4a\x01z", 5);  // unknown fields 8, 9
    std::vector<size_t> at;
    for (int i = rng() % 5; i > 0; --i) at.push_back(rng() % (bytes.size() + 1));
    std::sort(at.begin(), at.end());
    ParamChunkView view;
    ASSERT_TRUE(ParseParamChunk(CutAt(bytes, at), &view).ok()) << trial;
    EXPECT_EQ(view.version, chunk.version());
    EXPECT_EQ(view.layer_id, chunk.layer_id());
    EXPECT_EQ(view.offset, chunk.offset());
    EXPECT_EQ(view.layer_elements, chunk.layer_elements());
    EXPECT_EQ(view.group_version, chunk.group_version());
    EXPECT_EQ(view.data_size, data.size());
    EXPECT_EQ(Joined(view.data), data);
  }
  ParamChunkView view;
  EXPECT_THAT(ParseParamChunk({std::string("\x2a\x09"
                                           "abc",
                                           5)},
                              &view)
                  .message(),
              HasSubstr("malformed push message: truncated length-delimited field (field 5)"));
}

TEST(PushWireTest, MalformedMessagesAreRefusedLikeProtobufRefusesThem) {
  struct Case {
    std::string bytes;
    std::string says;
  };
  const std::vector<Case> cases = {
      {std::string("\x22\x05"
                   "abc",
                   5),
       "truncated length-delimited field (field 4)"},
      {std::string("\x22\x80", 2), "truncated length-delimited field (field 4)"},
      {std::string("\x10\xff\xff", 3), "bad varint (field 2)"},
      {std::string("\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12), "bad varint (field 3)"},
      {std::string("\x1d\x01\x02", 3), "truncated fixed32 (field 3)"},
      {std::string("\x19\x01\x02", 3), "truncated fixed64 (field 3)"},
      {std::string("\x08\x01", 2), "bad header (field 1)"},  // header as a varint is fine...
      {std::string("\x0a\x02\x08\xff", 4), "bad header (field 1)"},
      {std::string("\x02\x00", 2), "field number 0"},
      {std::string("\x26", 1), "wire type 6 (field 4)"},
      {std::string("\x27", 1), "wire type 7 (field 4)"},
      {std::string("\x23\x24", 2), "wire type 3 (field 4)"},
      {std::string("\xff\xff\xff\xff\xff\x01", 6), "bad tag"},
  };
  for (const Case& c : cases) {
    v1::PushChunk protobuf;
    const bool protobuf_ok = protobuf.ParseFromString(c.bytes);
    PushChunkView view;
    const absl::Status s = ParsePushChunk({c.bytes}, &view);
    if (c.bytes == std::string("\x08\x01", 2)) {
      // ...an unknown-typed field 1 is skipped by both.
      EXPECT_TRUE(protobuf_ok);
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_FALSE(view.has_header);
      continue;
    }
    if (c.says != "wire type 3 (field 4)") {
      EXPECT_FALSE(protobuf_ok) << c.says;  // the one difference: unknown groups
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_THAT(s.message(), HasSubstr("malformed push message: " + c.says));
    // Cut anywhere, the same answer.
    for (size_t at = 0; at <= c.bytes.size(); ++at) {
      EXPECT_EQ(ParsePushChunk(CutAt(c.bytes, {at}), &view), s) << c.says << " cut at " << at;
    }
  }
}

}  // namespace
}  // namespace aloe
