// WorkerPushCodec: a simulated worker's push encoded as aloe-worker encodes it and decoded as the
// server decodes it; its byte counts (hand-computed), error feedback across pushes, low-rank warm
// starts that persist per worker, refusals and group pushes. Also PushBytes' planning estimate
// of low-rank layers.
#include "sim/push_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "sim/link_model.h"

namespace aloe::sim {
namespace {

using ::testing::HasSubstr;

// vocab 16, seq 8, d_model 8, 2 blocks, ffn 32: embed 192 values, each block 872, head 144.
v1::ModelSpec TinySpec() {
  v1::TransformerConfig model;
  model.set_vocab_size(16);
  model.set_seq_len(8);
  model.set_d_model(8);
  model.set_num_layers(2);
  model.set_num_heads(2);
  model.set_ffn_mult(4);
  return BuildTransformerSpec(model, 1);
}

// A deterministic pseudo-gradient of every layer: values of about 1e-2, different per element
// and per `salt`.
std::vector<std::vector<float>> Gradient(const v1::ModelSpec& spec, int salt = 0) {
  std::vector<std::vector<float>> layers;
  for (const v1::LayerSpec& layer : spec.layers()) {
    std::vector<float>& v = layers.emplace_back(layer.num_elements());
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = 0.01f * static_cast<float>(std::sin(0.37 * i + 1.3 * layer.id() + 0.11 * salt));
    }
  }
  return layers;
}

server::PendingUpdate Update(std::vector<std::vector<float>> layers) {
  server::PendingUpdate u;
  u.layers = std::move(layers);
  return u;
}

// Every layer in `codec`, int8 blocks of 256, int4 blocks of 64.
v1::TransportConfig Transport(v1::Codec codec) {
  v1::TransportConfig transport;
  transport.set_codec(codec);
  transport.set_int8_block_size(256);
  transport.set_int4_block_size(64);
  return transport;
}

v1::TransportConfig LowRankBlock0(uint32_t rank, v1::Codec factor_codec) {
  v1::TransportConfig transport = Transport(v1::CODEC_FP32);
  v1::LayerCodec* c = transport.add_layer_codecs();
  c->set_layer("blocks.0");
  c->set_codec(v1::CODEC_LOWRANK);
  c->set_rank(rank);
  c->set_factor_codec(factor_codec);
  return transport;
}

double SquaredDistance(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
  return d;
}

TEST(WorkerPushCodecTest, Float32PushesArriveAsTheyAre) {
  const v1::ModelSpec spec = TinySpec();
  v1::TransportConfig transport;  // UNSPECIFIED = FP32
  WorkerPushCodec codec(spec, transport);
  EXPECT_TRUE(codec.exact());
  server::PendingUpdate u = Update(Gradient(spec));
  const EncodedPush push = codec.Encode(u, {});
  ASSERT_THAT(push.status, testing::IsOk());
  EXPECT_EQ(push.bytes, 4u * 2080u);
  EXPECT_EQ(u.layers, Gradient(spec));
}

TEST(WorkerPushCodecTest, LowRankPushBytesMatchTheHandCount) {
  const v1::ModelSpec spec = TinySpec();
  // blocks.0 at rank 2 with float32 factors; every compressed tensor is one chunk of a 40-byte
  // header, Q (cols x 2) and P (rows x 2):
  //   qkv 24x8: 40 + 4 (8 + 24) 2 = 296     proj 8x8: 40 + 4 (8 + 8) 2 = 168
  //   fc1 32x8: 40 + 4 (8 + 32) 2 = 360     fc2 8x32: 40 + 4 (32 + 8) 2 = 360
  // and its 1-D tensors as float32: ln1 16, qkv bias 24, proj bias 8, ln2 16, fc1 bias 32,
  // fc2 bias 8 = 104 values, 416 bytes. The other layers float32: (192 + 872 + 144) 4 = 4832.
  const uint64_t fp32_factors = 296 + 168 + 360 + 360 + 416 + 4832;
  EXPECT_EQ(fp32_factors, 6432u);
  // int4 factors in blocks of 64 (16-byte header, 4 per block, 1 per 2 values): Q of 16 values
  // is 28 bytes, of 64 values 52; P of 48 values 44, 16 values 28, 64 values 52:
  //   qkv 40 + 28 + 44 = 112   proj 40 + 28 + 28 = 96   fc1 40 + 28 + 52 = 120
  //   fc2 40 + 52 + 28 = 120; the 1-D tensors stay float32 (LowRankFallbackCodec).
  const uint64_t int4_factors = 112 + 96 + 120 + 120 + 416 + 4832;
  for (const auto& [factor_codec, bytes] : {std::pair{v1::CODEC_FP32, fp32_factors},
                                            std::pair{v1::CODEC_INT4_BLOCKWISE, int4_factors}}) {
    const v1::TransportConfig transport = LowRankBlock0(2, factor_codec);
    EXPECT_EQ(PushBytes(spec, transport), bytes) << v1::Codec_Name(factor_codec);
    WorkerPushCodec codec(spec, transport);
    EXPECT_FALSE(codec.exact());
    server::PendingUpdate u = Update(Gradient(spec));
    const EncodedPush push = codec.Encode(u, {});
    ASSERT_THAT(push.status, testing::IsOk());
    EXPECT_EQ(push.bytes, bytes) << v1::Codec_Name(factor_codec);
    // Only blocks.0 changed, and it is a rank-2 approximation, not the pseudo-gradient.
    const auto exact = Gradient(spec);
    EXPECT_EQ(u.layers[0], exact[0]);
    EXPECT_EQ(u.layers[2], exact[2]);
    EXPECT_EQ(u.layers[3], exact[3]);
    EXPECT_NE(u.layers[1], exact[1]);
    EXPECT_LT(SquaredDistance(u.layers[1], exact[1]),
              SquaredDistance(std::vector<float>(exact[1].size()), exact[1]));
  }
}

TEST(WorkerPushCodecTest, ErrorFeedbackMakesTheDecodedSumTrackTheTrueSum) {
  const v1::ModelSpec spec = TinySpec();
  v1::TransportConfig transport = Transport(v1::CODEC_INT4_BLOCKWISE);
  // The same pseudo-gradient pushed 20 times: without feedback each push makes the same
  // rounding error, so the sum's error grows 20-fold; with it the sum is off by at most the
  // last residual.
  double error[2] = {0, 0};
  for (bool feedback : {false, true}) {
    transport.set_error_feedback(feedback);
    WorkerPushCodec codec(spec, transport);
    const auto exact = Gradient(spec);
    std::vector<float> sum(exact[1].size(), 0.0f), truth(exact[1].size(), 0.0f);
    for (int round = 0; round < 20; ++round) {
      server::PendingUpdate u = Update(exact);
      const EncodedPush push = codec.Encode(u, {});
      ASSERT_THAT(push.status, testing::IsOk());
      EXPECT_EQ(push.bytes, PushBytes(spec, transport));
      for (size_t i = 0; i < sum.size(); ++i) {
        sum[i] += u.layers[1][i];
        truth[i] += exact[1][i];
      }
    }
    error[feedback] = std::sqrt(SquaredDistance(sum, truth));
  }
  EXPECT_GT(error[0], 0);
  EXPECT_LT(error[1] * 10, error[0]);
}

TEST(WorkerPushCodecTest, LowRankWarmStartsPersistUntilReset) {
  const v1::ModelSpec spec = TinySpec();
  // No error feedback: every push compresses the same matrix, whose spectrum decays, and each
  // power iteration starts from the last one's Q: the approximation improves push by push.
  const v1::TransportConfig transport = LowRankBlock0(1, v1::CODEC_FP32);
  WorkerPushCodec codec(spec, transport);
  const auto exact = Gradient(spec);
  std::vector<double> errors;
  for (int round = 0; round < 4; ++round) {
    server::PendingUpdate u = Update(exact);
    ASSERT_THAT(codec.Encode(u, {}).status, testing::IsOk());
    errors.push_back(SquaredDistance(u.layers[1], exact[1]));
  }
  EXPECT_LT(errors[3], errors[0] * (1 - 1e-3));
  // A worker process that ended starts over: the first push again.
  codec.Reset();
  server::PendingUpdate u = Update(exact);
  ASSERT_THAT(codec.Encode(u, {}).status, testing::IsOk());
  EXPECT_EQ(SquaredDistance(u.layers[1], exact[1]), errors[0]);
}

TEST(WorkerPushCodecTest, UndecodablePushesAreRefused) {
  const v1::ModelSpec spec = TinySpec();
  v1::TransportConfig transport = Transport(v1::CODEC_INT8_BLOCKWISE);
  WorkerPushCodec codec(spec, transport);
  server::PendingUpdate nan = Update(Gradient(spec));
  nan.layers[2][5] = std::numeric_limits<float>::quiet_NaN();
  const EncodedPush refused = codec.Encode(nan, {});
  EXPECT_THAT(refused.status,
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("encoding layer 2")));
  EXPECT_EQ(refused.bytes, PushBytes(spec, transport));
  // Encodable, but beyond the server's pseudo-gradient magnitude limit.
  server::PendingUpdate huge = Update(Gradient(spec));
  huge.layers[3][0] = 3e6f;
  EXPECT_THAT(codec.Encode(huge, {}).status,
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magnitude")));
}

TEST(WorkerPushCodecTest, GroupPushCarriesOnlyItsLayers) {
  const v1::ModelSpec spec = TinySpec();
  v1::TransportConfig transport;
  transport.set_codec(v1::CODEC_BF16);
  WorkerPushCodec codec(spec, transport);
  const std::vector<uint32_t> groups = {0, 0, 1, 1};
  server::PendingUpdate u = Update(Gradient(spec));
  u.layers[0].clear();
  u.layers[1].clear();
  u.group = 1;
  const EncodedPush push = codec.Encode(u, groups);
  ASSERT_THAT(push.status, testing::IsOk());
  EXPECT_EQ(push.bytes, 2u * (872u + 144u));
  const size_t group_layers[] = {2, 3};
  EXPECT_EQ(push.bytes, PushBytes(spec, transport, group_layers));
  EXPECT_TRUE(u.layers[0].empty());
  EXPECT_TRUE(u.layers[1].empty());
  ASSERT_EQ(u.layers[2].size(), 872u);
  EXPECT_NE(u.layers[2], Gradient(spec)[2]);  // bf16, not exact
  EXPECT_LT(std::sqrt(SquaredDistance(u.layers[2], Gradient(spec)[2])), 1e-3);
}

}  // namespace
}  // namespace aloe::sim
