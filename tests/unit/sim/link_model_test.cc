// The simulator's link model: FIFO arrival times, peak bytes/s on hand examples, wire bytes of
// pulls and encoded pushes, and --links parsing.
#include "sim/link_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "common/status_matchers.h"

namespace aloe::sim {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

TEST(LinkTest, TransfersQueueAndEachPaysLatencyPlusBytesOverRate) {
  Link link(/*bytes_per_second=*/1e6, /*latency_seconds=*/0.05);
  // Idle link: 50 ms + 1 MB at 1 MB/s.
  EXPECT_NEAR(Seconds(link.Enqueue(1000000, absl::ZeroDuration())), 1.05, 1e-9);
  // Ready at 0.5 s, but the first one holds the link until 1.05 s.
  EXPECT_NEAR(Seconds(link.Enqueue(500000, absl::Seconds(0.5))), 1.05 + 0.05 + 0.5, 1e-9);
  // Ready after the link went idle: starts when ready.
  EXPECT_NEAR(Seconds(link.Enqueue(0, absl::Seconds(3))), 3.05, 1e-9);
  EXPECT_NEAR(Seconds(link.busy_until()), 3.05, 1e-9);
  EXPECT_EQ(link.bytes(), 1500000u);
  EXPECT_EQ(link.transfers(), 3u);
}

TEST(LinkTest, InfiniteLinkDeliversWhenReady) {
  Link link(std::numeric_limits<double>::infinity(), 0);
  EXPECT_EQ(link.Enqueue(123456789, absl::Seconds(2)), absl::Seconds(2));
  EXPECT_EQ(link.Enqueue(1, absl::Seconds(2)), absl::Seconds(2));
  EXPECT_EQ(link.Enqueue(1, absl::Seconds(7)), absl::Seconds(7));
  EXPECT_EQ(link.bytes(), 123456791u);
}

TEST(LinkTest, PeakOfInstantTransfersCountsBothEndsOfTheWindow) {
  Link link(std::numeric_limits<double>::infinity(), 0);
  EXPECT_EQ(link.PeakBytesPerSecond(absl::Seconds(1)), 0);
  link.Enqueue(100, absl::Seconds(0));
  link.Enqueue(200, absl::Seconds(0.5));
  link.Enqueue(400, absl::Seconds(1.2));
  link.Enqueue(50, absl::Seconds(3));
  // 1 s: [0.2, 1.2] or [0.5, 1.5] hold 200 + 400 bytes.
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(1)), 600, 1e-9);
  // 0.5 s: [0.7, 1.2] holds 400 (more than [0, 0.5]: 300).
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(0.5)), 800, 1e-9);
  // 10 s: everything.
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(10)), 75, 1e-9);
}

TEST(LinkTest, PeakOfRateLimitedTransfersSpreadsTheirBytes) {
  Link link(/*bytes_per_second=*/1000, /*latency_seconds=*/0.25);
  // Received over [0.25, 1.25], then (queued) over [1.5, 2.0].
  EXPECT_NEAR(Seconds(link.Enqueue(1000, absl::ZeroDuration())), 1.25, 1e-9);
  EXPECT_NEAR(Seconds(link.Enqueue(500, absl::Seconds(1))), 2.0, 1e-9);
  // A window of 1 s sees at most the link rate.
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(1)), 1000, 1e-6);
  // [0.25, 2.0] holds all 1500 bytes.
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(1.75)), 1500 / 1.75, 1e-6);
  // [0.25, 1.45] or anything 1.2 s long: 1000 bytes, plus at most 0.2 s of the second (the
  // 0.25 s gap between them is idle): [0.55, 1.75] holds 700 + 250.
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(1.2)), 1000 / 1.2, 1e-6);
  // 4 s: 1500 / 4.
  EXPECT_NEAR(link.PeakBytesPerSecond(absl::Seconds(4)), 375, 1e-6);
}

TEST(LinkTest, SharedLinkQueuesTransfersOfAllItsUsers) {
  const double inf = std::numeric_limits<double>::infinity();
  Link server(/*bytes_per_second=*/1000, /*latency_seconds=*/0);
  Link a(inf, 0);
  Link b(inf, 0);
  Link slow(/*bytes_per_second=*/500, /*latency_seconds=*/0.5);
  // Both ready at 0: the server link sends a's, then b's.
  EXPECT_NEAR(Seconds(a.Enqueue(1000, absl::ZeroDuration(), &server)), 1, 1e-9);
  EXPECT_NEAR(Seconds(b.Enqueue(1000, absl::ZeroDuration(), &server)), 2, 1e-9);
  // a is free at 1 s, the server link only at 2 s.
  EXPECT_NEAR(Seconds(a.Enqueue(500, absl::Seconds(0.5), &server)), 2.5, 1e-9);
  // A worker link slower than the server's: its own arrival (10 + 0.5 + 2) is the later one.
  EXPECT_NEAR(Seconds(slow.Enqueue(1000, absl::Seconds(10), &server)), 12.5, 1e-9);
  EXPECT_NEAR(Seconds(server.busy_until()), 11, 1e-9);
  EXPECT_EQ(server.bytes(), 3500u);
  EXPECT_EQ(a.bytes(), 1500u);
  // The server link received 2500 bytes back to back over [0, 2.5].
  EXPECT_NEAR(server.PeakBytesPerSecond(absl::Seconds(2.5)), 1000, 1e-6);
  // b's bytes arrived at once (an infinitely fast link) when the server link had sent them.
  EXPECT_NEAR(b.PeakBytesPerSecond(absl::Seconds(1)), 1000, 1e-6);
}

v1::ModelSpec TwoLayerSpec() {
  v1::ModelSpec spec;
  v1::LayerSpec* embed = spec.add_layers();
  embed->set_name("embed");
  embed->set_num_elements(1000);
  v1::LayerSpec* head = spec.add_layers();
  head->set_name("head");
  head->set_num_elements(1100000);
  return spec;
}

TEST(WireBytesTest, PullIsFloat32AndPushFollowsTheCodecs) {
  const v1::ModelSpec spec = TwoLayerSpec();
  EXPECT_EQ(PullBytes(spec), 4u * 1101000u);
  v1::TransportConfig transport;
  transport.set_codec(v1::CODEC_FP32);
  EXPECT_EQ(PushBytes(spec, transport), 4u * 1101000u);
  transport.set_codec(v1::CODEC_UNSPECIFIED);
  EXPECT_EQ(PushBytes(spec, transport), 4u * 1101000u);
  transport.set_codec(v1::CODEC_BF16);
  EXPECT_EQ(PushBytes(spec, transport), 2u * 1101000u);
  // int8, blocks of 256, "embed" overridden to bf16. "head" goes in two chunks: 4028 blocks
  // (1031168 values) fill the first 1 MiB chunk, 68832 values (269 blocks) the second; each
  // chunk has a 16-byte header and 4 bytes per block.
  transport.set_codec(v1::CODEC_INT8_BLOCKWISE);
  transport.set_int8_block_size(256);
  v1::LayerCodec* embed = transport.add_layer_codecs();
  embed->set_layer("embed");
  embed->set_codec(v1::CODEC_BF16);
  EXPECT_EQ(PushBytes(spec, transport),
            2u * 1000u + (16u + 4u * 4028u + 1031168u) + (16u + 4u * 269u + 68832u));
  // One layer (a group's push or pull).
  const size_t embed_only[] = {0};
  const size_t head_only[] = {1};
  EXPECT_EQ(PushBytes(spec, transport, embed_only), 2u * 1000u);
  EXPECT_EQ(PushBytes(spec, transport, head_only),
            (16u + 4u * 4028u + 1031168u) + (16u + 4u * 269u + 68832u));
  EXPECT_EQ(PullBytes(spec, head_only), 4u * 1100000u);
  // int4 in blocks of 64: "head" fits one chunk of 17188 blocks (the last one short) and
  // 550000 bytes of levels.
  transport.set_codec(v1::CODEC_INT4_BLOCKWISE);
  transport.set_int4_block_size(64);
  EXPECT_EQ(PushBytes(spec, transport, head_only), 16u + 4u * 17188u + 550000u);
}

TEST(ParseLinksTest, ParsesSymmetricAsymmetricAndInfiniteLinks) {
  auto links = ParseLinks("100:20, 10/80:35.5,inf:0");
  ASSERT_THAT(links, IsOk());
  ASSERT_EQ(links->size(), 3u);
  EXPECT_DOUBLE_EQ((*links)[0].up_bytes_per_second, 12.5e6);
  EXPECT_DOUBLE_EQ((*links)[0].down_bytes_per_second, 12.5e6);
  EXPECT_DOUBLE_EQ((*links)[0].latency_seconds, 0.02);
  EXPECT_DOUBLE_EQ((*links)[1].up_bytes_per_second, 1.25e6);
  EXPECT_DOUBLE_EQ((*links)[1].down_bytes_per_second, 10e6);
  EXPECT_DOUBLE_EQ((*links)[1].latency_seconds, 0.0355);
  EXPECT_EQ((*links)[2].up_bytes_per_second, std::numeric_limits<double>::infinity());
  EXPECT_EQ((*links)[2].latency_seconds, 0);
  EXPECT_THAT(ParseLinks(""), IsOk());
  EXPECT_TRUE(ParseLinks(" ")->empty());
}

TEST(ParseLinksTest, NamesTheBadItem) {
  EXPECT_THAT(ParseLinks("100:20,100"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("link '100': expected RATE_MBIT:LATENCY_MS")));
  EXPECT_THAT(ParseLinks("0:20"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("link '0:20': rates")));
  EXPECT_THAT(ParseLinks("10/-1:20"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("link '10/-1:20'")));
  EXPECT_THAT(ParseLinks("fast:20"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'fast'")));
  EXPECT_THAT(ParseLinks("10:-5"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("link '10:-5': the latency")));
  EXPECT_THAT(ParseLinks("10:inf"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("finite milliseconds")));
  EXPECT_THAT(ParseLinks("10:"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got ''")));
}

}  // namespace
}  // namespace aloe::sim
