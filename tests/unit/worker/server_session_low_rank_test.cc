// A rank of a multi-rank (FSDP) node holds slices of layers, from which no tensor's low-rank
// factors can be computed alone: before each push the node's ranks compute them together over
// the node's process group (common/low_rank_fsdp.h), and each rank's encoder then encodes its
// slice with them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/low_rank_push.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "tests/testing/in_process_all_reduce.h"
#include "tests/unit/worker/fake_server.h"
#include "worker/fsdp.h"
#include "worker/server_session.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::InProcessAllReduce;
using ::aloe::testing::IsOk;
using ::aloe::testing::RunRankThreads;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

v1::JoinReply Reply(v1::Codec head_codec) {
  v1::JoinReply reply;
  reply.set_worker_id(1);
  for (const char* name : {"embed", "head"}) {
    v1::LayerSpec* layer = reply.mutable_model_spec()->add_layers();
    layer->set_name(name);
    v1::TensorSpec* w = layer->add_tensors();
    w->set_name("w");
    w->add_shape(8);
    w->add_shape(8);
    layer->set_num_elements(64);
  }
  v1::LayerCodec* head = reply.mutable_transport()->add_layer_codecs();
  head->set_layer("head");
  head->set_codec(head_codec);
  if (head_codec == v1::CODEC_LOWRANK) head->set_rank(2);
  return reply;
}

// A rank of an in-process node whose only collective is the float all-reduce of a push.
class AllReduceOnly final : public Collectives {
 public:
  AllReduceOnly(InProcessAllReduce& node, int rank, int size)
      : node_(node), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllGather(const float*, size_t, float*) override { return Unused(); }
  absl::Status ReduceScatterSum(const float*, size_t, float*) override { return Unused(); }
  absl::StatusOr<double> AllReduceSum(double) override { return Unused(); }
  absl::Status Broadcast(std::string*, int) override { return Unused(); }
  absl::Status AllReduceSumFloats(float* values, size_t n) override {
    return node_.AllReduce(rank_, absl::MakeSpan(values, n));
  }

 private:
  static absl::Status Unused() { return absl::UnimplementedError("not in this test"); }
  InProcessAllReduce& node_;
  const int rank_;
  const int size_;
};

// The layer "head" (an 8 x 8 matrix) of a push.
std::vector<float> Head() {
  std::vector<float> head(64);
  for (int i = 0; i < 64; ++i) head[i] = std::sin(0.7f * i) + 0.1f * (i % 8);
  return head;
}

TEST(ServerSessionLowRankTest, RanksOfANodeCompressTheirSlicesTogetherBeforeEachPush) {
  const v1::JoinReply reply = Reply(v1::CODEC_LOWRANK);
  const std::vector<float> head = Head();
  // One rank's encoding of the whole layer: what the node's two ranks must send between them.
  LowRankPushEncoder one;
  one.Configure(reply.transport(), reply.model_spec());
  std::vector<EncodedChunk> whole;
  ASSERT_THAT(one.EncodeLayer(1, /*task_id=*/0, head, nullptr, &whole, kMaxChunkBytes), IsOk());
  ASSERT_EQ(whole.size(), 1u);
  std::vector<float> expected(64);
  ASSERT_THAT(DecodeChunk(whole[0].codec, whole[0].payload, absl::MakeSpan(expected)), IsOk());

  InProcessAllReduce node(2);
  std::vector<float> decoded(64, 0.0f);
  RunRankThreads(2, [&](int r) {
    FakeServer server;
    FakeClock clock;
    std::atomic<bool> stop{false};
    AgentOptions options;
    AllReduceOnly collectives(node, r, 2);
    AgentEnv env;
    env.server = &server;
    env.clock = &clock;
    env.sleep = [&](absl::Duration d) { clock.Advance(d); };
    env.stop = &stop;
    env.node = &collectives;
    ServerSession session(options, env, "w", r, 2);
    ASSERT_THAT(session.Adopt(reply), IsOk());
    const auto [b, e] = SliceRange(64, 2, r);
    std::vector<std::vector<float>> delta = {std::vector<float>(32, 0.5f),
                                             {head.begin() + b, head.begin() + e}};
    uint64_t pushed = 0;
    ASSERT_THAT(session.Push(v1::PushHeader(), delta, &pushed), IsOk());
    // The encoder the client gets encodes this rank's slice with the node's factors.
    std::shared_ptr<LowRankPushEncoder> encoder = server.low_rank_encoder();
    ASSERT_NE(encoder, nullptr);
    std::vector<EncodedChunk> chunks;
    ASSERT_THAT(encoder->EncodeLayer(1, /*task_id=*/0, delta[1], nullptr, &chunks, kMaxChunkBytes),
                IsOk());
    uint64_t next = b;
    for (const EncodedChunk& chunk : chunks) {
      ASSERT_EQ(chunk.offset, next);
      absl::StatusOr<size_t> n = EncodedElementCount(chunk.codec, chunk.payload);
      ASSERT_THAT(n.status(), IsOk());
      ASSERT_THAT(DecodeChunk(chunk.codec, chunk.payload,
                              absl::MakeSpan(decoded).subspan(chunk.offset, *n)),
                  IsOk());
      next += *n;
    }
    EXPECT_EQ(next, e);
  });
  // P and Q, then nothing more.
  EXPECT_EQ(node.calls(), 2);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(decoded[i], expected[i], 1e-5) << i;
}

TEST(ServerSessionLowRankTest, ASlicedLowRankPushNeedsTheNodesProcessGroup) {
  FakeServer server;
  FakeClock clock;
  std::atomic<bool> stop{false};
  AgentOptions options;
  AgentEnv env;
  env.server = &server;
  env.clock = &clock;
  env.sleep = [&](absl::Duration d) { clock.Advance(d); };
  env.stop = &stop;
  ServerSession rank1(options, env, "w", 1, 2);
  ASSERT_THAT(rank1.Adopt(Reply(v1::CODEC_LOWRANK)), IsOk());
  std::vector<std::vector<float>> delta = {std::vector<float>(32), std::vector<float>(32)};
  uint64_t pushed = 0;
  EXPECT_THAT(rank1.Push(v1::PushHeader(), delta, &pushed),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("process group")));
  EXPECT_TRUE(server.pushes().empty());
  // Without low-rank layers a rank needs none.
  ASSERT_THAT(rank1.Adopt(Reply(v1::CODEC_INT8_BLOCKWISE)), IsOk());
  EXPECT_THAT(rank1.Push(v1::PushHeader(), delta, &pushed), IsOk());
  ServerSession whole(options, env, "w", 0, 1);
  EXPECT_THAT(whole.Adopt(Reply(v1::CODEC_LOWRANK)), IsOk());
}

}  // namespace
}  // namespace aloe::worker
