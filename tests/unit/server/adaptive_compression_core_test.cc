// Adaptive rank (paper 001 Alg. 3, TransportConfig.adaptive_rank) through ServerCore: the
// effective ranks of accepted pushes choose every low-rank tensor's rank and the local steps of
// the next tasks; bad observations are refused with nothing recorded; checkpoints resume the
// windows exactly. Golden numbers are worked out by hand in the comments.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <utility>

#include "common/config.h"
#include "common/low_rank_wire.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "server/core/adaptive_compression.h"
#include "server/core/server_core.h"
#include "server/core/server_metrics.h"
#include "tests/testing/low_rank_testing.h"
#include "tests/testing/server_core_calls.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// d = 16, ffn 64: layer 1 (blocks.0) holds the 2-D tensors 2 qkv [48, 16], 4 proj [16, 16], 8
// fc1 [64, 16] and 10 fc2 [16, 64]; pushed low-rank at rank 4, so r_0 = 4 for each. Their
// factors are smaller than they are up to ranks 11, 7, 12 and 12 (the greatest r with (m + n) r
// < m n), which caps their ranks. Widths m + n: 64, 32, 80, 80; at r_0 they sum to 4 * 256.
v1::ServerConfig AdaptiveConfig(uint32_t window = 2) {
  v1::ServerConfig config;
  config.mutable_model()->set_vocab_size(16);
  config.mutable_model()->set_seq_len(8);
  config.mutable_model()->set_d_model(16);
  config.mutable_model()->set_num_layers(1);
  config.mutable_model()->set_num_heads(2);
  config.set_corpus_dir("unused");
  config.set_local_steps(100);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_grace_seconds(0);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_SGD);
  config.mutable_outer_optimizer()->set_lr(0.5f);
  v1::LayerCodec* codec = config.mutable_transport()->add_layer_codecs();
  codec->set_layer("blocks.0");
  codec->set_codec(v1::CODEC_LOWRANK);
  codec->set_rank(4);
  codec->set_factor_codec(v1::CODEC_INT8_BLOCKWISE);
  v1::AdaptiveRankConfig* adaptive = config.mutable_transport()->mutable_adaptive_rank();
  adaptive->set_enabled(true);
  adaptive->set_window(window);
  adaptive->set_adapt_local_steps(true);
  FillServerDefaults(&config);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

// tensor index -> rank in the task.
std::map<uint32_t, uint32_t> RanksOf(const v1::Task& task) {
  std::map<uint32_t, uint32_t> ranks;
  for (const v1::TensorRank& r : task.tensor_ranks()) {
    EXPECT_EQ(r.layer(), 1u);
    ranks[r.tensor()] = r.rank();
  }
  return ranks;
}

class AdaptiveCompressionCoreTest : public ::testing::Test {
 protected:
  void Make(const v1::ServerConfig& config) {
    auto core = ServerCore::Create(config, {{"a", "a.tok", 1000}}, "heldout.tok", clock_, executor_,
                                   metrics_);
    ASSERT_THAT(core, IsOk());
    core_ = *std::move(core);
    worker_ = ::aloe::testing::JoinTrainer(*core_);
  }

  v1::Task Request() { return ::aloe::testing::RequestTaskOf(*core_, worker_); }

  // A push of `task` (every element 0.01) observing {tensor index -> effective rank} of layer 1.
  absl::StatusOr<v1::PushReply> Push(const v1::Task& task,
                                     const std::map<uint32_t, uint32_t>& observed,
                                     uint32_t layer = 1) {
    PendingUpdate u;
    u.worker_id = worker_;
    u.task_id = task.task_id();
    u.base_version = task.base_version();
    u.steps_done = task.local_steps();
    u.tokens_learned = 100;
    u.compute_seconds = 1.0;
    for (const auto& l : core_->spec().layers()) u.layers.emplace_back(l.num_elements(), 0.01f);
    for (auto [tensor, rank] : observed) {
      v1::TensorRank& r = u.observed_ranks.emplace_back();
      r.set_layer(layer);
      r.set_tensor(tensor);
      r.set_rank(rank);
    }
    return core_->SubmitUpdate(std::move(u));
  }

  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
  std::unique_ptr<ServerCore> core_;
  uint64_t worker_ = 0;
};

TEST_F(AdaptiveCompressionCoreTest, ObservedRanksChooseTheRanksAndTheLocalSteps) {
  Make(AdaptiveConfig());
  v1::Task task = Request();
  using Ranks = std::map<uint32_t, uint32_t>;
  EXPECT_EQ(RanksOf(task), (Ranks{{2, 4}, {4, 4}, {8, 4}, {10, 4}}));
  EXPECT_EQ(task.local_steps(), 100u);
  EXPECT_EQ(metrics_.Value(kLowRankRank, {"blocks.0", "blocks.0.attn.qkv.weight"}), 4);
  EXPECT_EQ(metrics_.Value(kAdaptiveLocalSteps), 100);

  // proj's 8 says its rank lies beyond the factors (2 x 4); its cap makes it 7. Ranks 2, 7, 1,
  // 3; H = round(100 * (64 * 2 + 32 * 7 + 80 * 1 + 80 * 3) / 1024) = round(65.63) = 66.
  ASSERT_THAT(Push(task, {{2, 2}, {4, 8}, {8, 1}, {10, 3}}), IsOk());
  task = Request();
  EXPECT_EQ(RanksOf(task), (Ranks{{2, 2}, {4, 7}, {8, 1}, {10, 3}}));
  EXPECT_EQ(task.local_steps(), 66u);
  EXPECT_EQ(metrics_.Value(kAdaptiveLocalSteps), 66);
  EXPECT_EQ(metrics_.Value(kLowRankEffectiveRank, {"blocks.0", "blocks.0.attn.proj.weight"}), 8);

  // Windows [2, 4], [8, 6], [1, 2], [3]: ranks 3, 7, 2, 3; H = round(100 * (192 + 224 + 160 +
  // 240) / 1024) = round(79.69) = 80.
  ASSERT_THAT(Push(task, {{2, 4}, {4, 6}, {8, 2}}), IsOk());
  task = Request();
  EXPECT_EQ(RanksOf(task), (Ranks{{2, 3}, {4, 7}, {8, 2}, {10, 3}}));
  EXPECT_EQ(task.local_steps(), 80u);
  EXPECT_EQ(metrics_.Value(kLowRankEffectiveRank, {"blocks.0", "blocks.0.mlp.fc1.weight"}), 1.5);

  // A window of 2 forgets qkv's first 2: [4, 6] gives 5 (a window of 3 would give 4).
  ASSERT_THAT(Push(task, {{2, 6}}), IsOk());
  task = Request();
  EXPECT_EQ(RanksOf(task)[2], 5u);
  EXPECT_EQ(metrics_.Value(kLowRankRank, {"blocks.0", "blocks.0.attn.qkv.weight"}), 5);
}

TEST_F(AdaptiveCompressionCoreTest, BadObservationsAreRefusedWithNothingRecorded) {
  Make(AdaptiveConfig());
  const v1::Task task = Request();
  EXPECT_THAT(Push(task, {{3, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 1, tensor 3: not a 2-D tensor of a low-rank layer")));
  EXPECT_THAT(Push(task, {{2, 2}}, /*layer=*/0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 0, tensor 2: not a 2-D tensor of a low-rank layer")));
  EXPECT_THAT(Push(task, {{2, 3}, {4, 33}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 1 (blocks.0), tensor 4 (blocks.0.attn.proj.weight): "
                                 "adaptive rank: effective rank 33 of layer 1/4 is outside "
                                 "[0, 32]")));
  EXPECT_THAT(Push(task, {{8, 33}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside [0, 32]")));
  // Nothing of the refused pushes counted: the task is still open and the ranks are r_0.
  ASSERT_THAT(Push(task, {{2, 1}}), IsOk());
  const v1::Task next = Request();
  EXPECT_EQ(RanksOf(next)[2], 1u);
  EXPECT_EQ(RanksOf(next)[4], 4u);
  EXPECT_EQ(metrics_.Value(kUpdatesRejected, {"invalid_argument"}), 4);
}

TEST_F(AdaptiveCompressionCoreTest, AServerThatDoesNotAdaptRefusesObservations) {
  v1::ServerConfig config = AdaptiveConfig();
  config.mutable_transport()->clear_adaptive_rank();
  Make(config);
  const v1::Task task = Request();
  EXPECT_TRUE(task.tensor_ranks().empty());
  EXPECT_THAT(Push(task, {{2, 2}}), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("transport.adaptive_rank is off")));
  EXPECT_THAT(Push(task, {}), IsOk());
}

TEST_F(AdaptiveCompressionCoreTest, CheckpointsResumeTheWindowsExactly) {
  Make(AdaptiveConfig(/*window=*/3));
  v1::Task task = Request();
  ASSERT_THAT(Push(task, {{2, 2}, {4, 8}, {8, 1}, {10, 3}}), IsOk());
  task = Request();
  ASSERT_THAT(Push(task, {{2, 4}, {8, 2}}), IsOk());
  const v1::ServerCheckpoint checkpoint = core_->CaptureCheckpoint();
  ASSERT_EQ(checkpoint.adaptive_ranks_size(), 4);
  const v1::Task before = Request();

  auto restored = ServerCore::Create(AdaptiveConfig(/*window=*/3), {{"a", "a.tok", 1000}},
                                     "heldout.tok", clock_, executor_, metrics_);
  ASSERT_THAT(restored, IsOk());
  ASSERT_THAT((*restored)->RestoreCheckpoint(checkpoint), IsOk());
  const uint64_t worker = ::aloe::testing::JoinTrainer(**restored);
  const v1::Task after = ::aloe::testing::RequestTaskOf(**restored, worker);
  EXPECT_EQ(RanksOf(after), RanksOf(before));
  EXPECT_EQ(after.local_steps(), before.local_steps());
  // Windows [2, 4], [8], [1, 2], [3]: ranks 3, 7 (capped), 2, 3; H = round(100 * (192 + 224 +
  // 160 + 240) / 1024) = round(79.69) = 80.
  EXPECT_EQ(after.local_steps(), 80u);

  // A checkpoint naming a tensor this model does not compress is refused, nothing restored.
  v1::ServerCheckpoint bad = checkpoint;
  bad.mutable_adaptive_ranks(0)->set_tensor(3);
  EXPECT_THAT((*restored)->RestoreCheckpoint(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1, tensor 3")));
  EXPECT_EQ(::aloe::testing::RequestTaskOf(**restored, worker).local_steps(), 80u);
}

TEST(AdaptiveCompressionConfigTest, BadConfigsNameTheProblem) {
  v1::TransportConfig transport;
  transport.mutable_adaptive_rank()->set_enabled(true);
  EXPECT_THAT(ValidateAdaptiveCompression(transport, 50),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no layer is CODEC_LOWRANK")));
  v1::LayerCodec* codec = transport.add_layer_codecs();
  codec->set_layer("head");
  codec->set_codec(v1::CODEC_LOWRANK);
  codec->set_rank(8);
  EXPECT_THAT(ValidateAdaptiveCompression(transport, 50), IsOk());
  transport.mutable_adaptive_rank()->set_energy_fraction(1.5);
  EXPECT_THAT(ValidateAdaptiveCompression(transport, 50),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("energy_fraction")));
  transport.mutable_adaptive_rank()->set_energy_fraction(0.9);
  transport.mutable_adaptive_rank()->set_max_local_steps(20);
  EXPECT_THAT(ValidateAdaptiveCompression(transport, 50),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("initial_local_steps is the job's local_steps")));
}

TEST(AdaptiveCompressionCapTest, RanksStayWhereQFitsOneChunk) {
  // w is 64 x 60000: in float32 its Q takes 240000 bytes per rank, so at most 4 ranks fit a
  // chunk of about 1 MiB with a row of P; its factors would stay smaller up to rank 63.
  v1::ModelSpec spec;
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_name("wide");
  ::aloe::testing::AddTensor(layer, "w", {64, 60000});
  v1::TransportConfig transport;
  v1::LayerCodec* codec = transport.add_layer_codecs();
  codec->set_layer("wide");
  codec->set_codec(v1::CODEC_LOWRANK);
  codec->set_rank(2);
  transport.mutable_adaptive_rank()->set_enabled(true);
  transport.mutable_adaptive_rank()->set_window(1);
  auto adaptive = AdaptiveCompression::Create(spec, transport, 10);
  ASSERT_THAT(adaptive, IsOk());
  ASSERT_NE(*adaptive, nullptr);
  v1::TensorRank observed;
  observed.set_layer(0);
  observed.set_tensor(0);
  observed.set_rank(40);
  ASSERT_THAT((*adaptive)->Check({observed}), IsOk());
  (*adaptive)->Record({observed});
  v1::Task task;
  (*adaptive)->FillTask(&task);
  ASSERT_EQ(task.tensor_ranks_size(), 1);
  EXPECT_EQ(task.tensor_ranks(0).rank(), 4u);
  // int4 factors take an eighth of the bytes: up to 34 ranks fit.
  codec->set_factor_codec(v1::CODEC_INT4_BLOCKWISE);
  adaptive = AdaptiveCompression::Create(spec, transport, 10);
  ASSERT_THAT(adaptive, IsOk());
  (*adaptive)->Record({observed});
  task.Clear();
  (*adaptive)->FillTask(&task);
  EXPECT_EQ(task.tensor_ranks(0).rank(),
            LowRankMaxChunkRank(60000, v1::CODEC_INT4_BLOCKWISE, 64, kMaxChunkBytes));
  EXPECT_GT(task.tensor_ranks(0).rank(), 20u);
  EXPECT_LT(task.tensor_ranks(0).rank(), 40u);
}

}  // namespace
}  // namespace aloe::server
