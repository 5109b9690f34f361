// A rank of a multi-rank (FSDP) node holds slices of layers, from which no tensor's low-rank
// factors can be computed: its session refuses a server with low-rank layers at join.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>

#include "common/clock.h"
#include "common/status_matchers.h"
#include "tests/unit/worker/fake_server.h"
#include "worker/server_session.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
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

TEST(ServerSessionLowRankTest, MultiRankNodesRefuseLowRankLayers) {
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
  EXPECT_THAT(
      rank1.Adopt(Reply(v1::CODEC_LOWRANK)),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("layer head is pushed low-rank")));
  EXPECT_THAT(rank1.Adopt(Reply(v1::CODEC_INT8_BLOCKWISE)), IsOk());
  ServerSession whole(options, env, "w", 0, 1);
  EXPECT_THAT(whole.Adopt(Reply(v1::CODEC_LOWRANK)), IsOk());
}

}  // namespace
}  // namespace aloe::worker
