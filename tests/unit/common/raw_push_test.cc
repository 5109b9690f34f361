#include "common/raw_push.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// Bytes from memory; kUnavailable past the end, as a closed connection.
class StringReader final : public ByteReader {
 public:
  explicit StringReader(std::string bytes) : bytes_(std::move(bytes)) {}
  absl::Status ReadExactly(char* out, size_t n) override {
    if (bytes_.size() - at_ < n) {
      at_ = bytes_.size();
      return absl::UnavailableError("the connection was closed");
    }
    std::memcpy(out, bytes_.data() + at_, n);
    at_ += n;
    return absl::OkStatus();
  }
  size_t left() const { return bytes_.size() - at_; }

 private:
  std::string bytes_;
  size_t at_ = 0;
};

v1::PushHeader Header() {
  v1::PushHeader header;
  header.set_worker_id(7);
  header.set_task_id(11);
  header.set_update_id(3);
  header.set_base_version(41);
  header.set_steps_done(20);
  header.set_tokens_learned(81920);
  return header;
}

TEST(RawPushTest, PreludeRoundTripsAndIsLaidOutAsDocumented) {
  const std::string bytes = EncodeRawPushPrelude("secret", Header(), 1234567890123ull);
  const std::string header = Header().SerializeAsString();
  ASSERT_EQ(bytes.size(), 4 + 4 + 4 + 6 + 4 + header.size() + 8);
  EXPECT_EQ(bytes.substr(0, 4), "ALRP");                        // magic
  EXPECT_EQ(bytes.substr(4, 4), std::string("\x01\0\0\0", 4));  // version 1
  EXPECT_EQ(bytes.substr(8, 4), std::string("\x06\0\0\0", 4));  // token length
  EXPECT_EQ(bytes.substr(12, 6), "secret");
  // 1234567890123 = 0x0000011f71fb04cb, little-endian at the end.
  EXPECT_EQ(bytes.substr(bytes.size() - 8), std::string("\xcb\x04\xfb\x71\x1f\x01\0\0", 8));
  StringReader in(bytes + "payload");
  bool nothing_read = true;
  absl::StatusOr<RawPushRequest> request = ReadRawPushPrelude(in, &nothing_read);
  ASSERT_THAT(request, IsOk());
  EXPECT_FALSE(nothing_read);
  EXPECT_EQ(request->token, "secret");
  EXPECT_EQ(request->header.SerializeAsString(), header);
  EXPECT_EQ(request->payload_bytes, 1234567890123ull);
  EXPECT_EQ(in.left(), 7u);  // the payload is left for the caller
}

TEST(RawPushTest, MalformedPreludesAreNamed) {
  const std::string good = EncodeRawPushPrelude("t", Header(), 8);
  struct Case {
    std::string bytes;
    const char* message;
  };
  std::string bad_magic = good;
  bad_magic[0] = 'P';  // e.g. an HTTP/2 client on the wrong port ("PRI * ...")
  std::string bad_version = good;
  bad_version[4] = 2;
  std::string long_token = good.substr(0, 8) + std::string("\x01\x10\0\0", 4);  // 4097
  std::string long_header =
      good.substr(0, 8) + std::string("\0\0\0\0", 4) + std::string("\x01\0\x01\0", 4);  // 65537
  std::string garbage_header =
      good.substr(0, 8) + std::string("\0\0\0\0", 4) + std::string("\x02\0\0\0", 4) + "\xff\xff";
  const Case cases[] = {
      {bad_magic, "not a raw push (magic 0x50524c50, expected 0x50524c41)"},
      {bad_version, "version 2, this server speaks version 1"},
      {long_token, "token of 4097 bytes, over the limit of 4096"},
      {long_header, "push header of 65537 bytes, over the limit of 65536"},
      {garbage_header, "the push header does not parse"},
  };
  for (const Case& c : cases) {
    StringReader in(c.bytes + std::string(64, '\0'));
    EXPECT_THAT(ReadRawPushPrelude(in),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
}

TEST(RawPushTest, PreludeCutAnywhereFailsAsTheConnectionDid) {
  const std::string good = EncodeRawPushPrelude("token", Header(), 4096);
  for (size_t cut = 0; cut < good.size(); ++cut) {
    StringReader in(good.substr(0, cut));
    bool nothing_read = false;
    EXPECT_THAT(ReadRawPushPrelude(in, &nothing_read),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("closed")))
        << "cut at " << cut;
    EXPECT_EQ(nothing_read, cut == 0) << "cut at " << cut;
  }
}

TEST(RawPushTest, RepliesCarryTheOutcome) {
  v1::PushReply reply;
  reply.set_applied(true);
  reply.set_version(42);
  {
    StringReader in(EncodeRawPushReply(absl::OkStatus(), reply));
    absl::Status carried = absl::UnknownError("unset");
    v1::PushReply got;
    ASSERT_THAT(ReadRawPushReply(in, &carried, &got), IsOk());
    EXPECT_THAT(carried, IsOk());
    EXPECT_TRUE(got.applied());
    EXPECT_EQ(got.version(), 42u);
  }
  {
    StringReader in(EncodeRawPushReply(absl::InvalidArgumentError("layer 2: NaN"), reply));
    absl::Status carried;
    v1::PushReply got;
    ASSERT_THAT(ReadRawPushReply(in, &carried, &got), IsOk());
    EXPECT_THAT(carried, StatusIs(absl::StatusCode::kInvalidArgument, "layer 2: NaN"));
    EXPECT_FALSE(got.applied());  // an error carries no reply
  }
  // Malformed replies are the transport's kDataLoss, not an outcome.
  const std::string unknown_code = std::string("\x11\0\0\0", 4) + std::string(8, '\0');
  const std::string long_message = std::string(4, '\0') + std::string("\x01\0\x01\0", 4);
  const std::string garbage_reply =
      std::string(8, '\0') + std::string("\x02\0\0\0", 4) + "\xff\xff";
  for (const std::string& bytes : {unknown_code, long_message, garbage_reply}) {
    StringReader in(bytes + std::string(16, '\0'));
    absl::Status carried;
    v1::PushReply got;
    EXPECT_THAT(ReadRawPushReply(in, &carried, &got),
                StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
  }
  StringReader cut(EncodeRawPushReply(absl::OkStatus(), reply).substr(0, 5));
  absl::Status carried;
  v1::PushReply got;
  EXPECT_THAT(ReadRawPushReply(cut, &carried, &got),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
}

TEST(RawPushTest, RangesAreTheShardsLayersOrEveryLayerInOrderWholeOrSliced) {
  v1::ModelSpec spec;
  const uint64_t sizes[] = {10, 7, 5, 3};
  const uint32_t shards[] = {1, 0, 1, 1};
  for (int l = 0; l < 4; ++l) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(l);
    layer->set_num_elements(sizes[l]);
    layer->set_shard(shards[l]);
  }
  v1::PushHeader whole;
  std::vector<RawPushRange> ranges = RawPushRanges(spec, 1, whole);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0].layer_id, 0u);
  EXPECT_EQ(ranges[1].layer_id, 2u);
  EXPECT_EQ(ranges[2].layer_id, 3u);
  EXPECT_EQ(ranges[2].first, 0u);
  EXPECT_EQ(ranges[2].count, 3u);
  EXPECT_EQ(RawPushPayloadBytes(ranges), (10 + 5 + 3) * 4u);
  // Slice 2 of 3 (SliceRange: ceil(n / 3) per slice): layer 0 [8, 10), layer 2 [4, 5), layer 3
  // [2, 3).
  v1::PushHeader sliced;
  sliced.set_slice(2);
  sliced.set_slices(3);
  ranges = RawPushRanges(spec, 1, sliced);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0].first, 8u);
  EXPECT_EQ(ranges[0].count, 2u);
  EXPECT_EQ(ranges[1].first, 4u);
  EXPECT_EQ(ranges[1].count, 1u);
  EXPECT_EQ(ranges[2].first, 2u);
  EXPECT_EQ(ranges[2].count, 1u);
  EXPECT_TRUE(RawPushRanges(spec, 2, whole).empty());
  // No shard (a single-process server): every layer, in order.
  ranges = RawPushRanges(spec, std::nullopt, sliced);
  ASSERT_EQ(ranges.size(), 4u);
  EXPECT_EQ(ranges[1].layer_id, 1u);
  EXPECT_EQ(ranges[1].first, 6u);  // layer 1 (7 elements): ceil(7 / 3) = 3 per slice, [6, 7)
  EXPECT_EQ(ranges[1].count, 1u);
  EXPECT_EQ(RawPushPayloadBytes(ranges), (2 + 1 + 1 + 1) * 4u);
  // Layer groups {0, 1, 1, 0}: a push of group 1 carries layers 1 and 2 only.
  const std::vector<uint32_t> groups = {0, 1, 1, 0};
  v1::PushHeader group1;
  group1.set_group(1);
  ranges = RawPushRanges(spec, std::nullopt, group1, groups);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].layer_id, 1u);
  EXPECT_EQ(ranges[0].count, 7u);
  EXPECT_EQ(ranges[1].layer_id, 2u);
  EXPECT_EQ(RawPushPayloadBytes(ranges), (7 + 5) * 4u);
  group1.set_group(2);  // a group no layer is in
  EXPECT_TRUE(RawPushRanges(spec, std::nullopt, group1, groups).empty());
}

TEST(RawPushTest, SocketsConnectCarryBytesTimeOutAndReportClosing) {
  int port = 0;
  absl::StatusOr<int> listener = ListenTcp("127.0.0.1:0", &port);
  ASSERT_THAT(listener, IsOk());
  ASSERT_GT(port, 0);
  absl::StatusOr<int> client = ConnectTcp("127.0.0.1:" + std::to_string(port), absl::Seconds(5));
  ASSERT_THAT(client, IsOk());
  const int server = accept(*listener, nullptr, nullptr);
  ASSERT_GE(server, 0);
  // 8 MiB: more than the socket buffers hold, so the writer waits for the reader.
  std::string sent(8 << 20, '\0');
  for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>(i * 131 + 7);
  std::thread writer(
      [&] { EXPECT_THAT(WriteAll(*client, sent.data(), sent.size(), absl::Seconds(10)), IsOk()); });
  std::string got(sent.size(), '\0');
  SocketStream in(server, absl::Seconds(10));
  ASSERT_THAT(in.ReadExactly(got.data(), got.size()), IsOk());
  writer.join();
  EXPECT_TRUE(got == sent);
  // Nothing more comes: the read times out, naming the wait.
  SocketStream impatient(server, absl::Milliseconds(50));
  char byte;
  EXPECT_THAT(impatient.ReadExactly(&byte, 1),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("no progress")));
  close(*client);
  EXPECT_THAT(in.ReadExactly(&byte, 1), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  close(server);
  close(*listener);
  EXPECT_THAT(ConnectTcp("127.0.0.1:" + std::to_string(port), absl::Seconds(2)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot connect")));
  EXPECT_THAT(ConnectTcp("no-port", absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(ListenTcp("127.0.0.1:99999", &port),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
}

}  // namespace
}  // namespace aloe
