// CODEC_LOWRANK chunks through the UpdateAssembler: decoded in place between the plain chunks
// of the layer's other tensors, checked against the spec's tensors, refused with nothing
// received.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/buffer_pool.h"
#include "common/low_rank.h"
#include "common/low_rank_push.h"
#include "common/low_rank_wire.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "server/core/update_assembler.h"
#include "tests/testing/low_rank_testing.h"

namespace aloe::server {
namespace {

using ::aloe::testing::AddTensor;
using ::aloe::testing::IsOk;
using ::aloe::testing::RandomMatrix;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// Layer 0 "blocks.0": bias [10], w [40, 30]; layer 1 "head": v [20, 30].
v1::ModelSpec Spec() {
  v1::ModelSpec spec;
  v1::LayerSpec* block = spec.add_layers();
  block->set_id(0);
  block->set_name("blocks.0");
  AddTensor(block, "bias", {10});
  AddTensor(block, "w", {40, 30});
  v1::LayerSpec* head = spec.add_layers();
  head->set_id(1);
  head->set_name("head");
  AddTensor(head, "v", {20, 30});
  return spec;
}

std::vector<float> Random(size_t n, uint32_t seed) { return RandomMatrix(n, 1, seed, 0.01f); }

TEST(UpdateAssemblerLowRankTest, LowRankChunksDecodeInPlaceIntoARecycledBuffer) {
  const v1::ModelSpec spec = Spec();
  v1::TransportConfig transport;
  for (const char* name : {"blocks.0", "head"}) {
    v1::LayerCodec* c = transport.add_layer_codecs();
    c->set_layer(name);
    c->set_codec(v1::CODEC_LOWRANK);
    c->set_rank(3);
    c->set_factor_codec(v1::CODEC_BF16);
  }
  LowRankPushEncoder encoder;
  encoder.Configure(transport, spec);
  // A pool whose buffers hold garbage: the decode must not add to what is there.
  auto pool = FloatBufferPool::Create(1 << 20);
  for (int i = 0; i < 2; ++i) {
    std::vector<float> used(1210, 123.0f);
    pool->Give(std::move(used));
    std::vector<float> used_head(600, -7.0f);
    pool->Give(std::move(used_head));
  }
  v1::PushHeader header;
  UpdateAssembler assembler(spec, header, std::nullopt, pool);
  std::vector<std::vector<float>> expected(2);
  uint64_t bytes = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    const std::vector<float> g = Random(spec.layers(l).num_elements(), l);
    std::vector<float> residual(g.size());
    std::vector<EncodedChunk> chunks;
    ASSERT_THAT(encoder.EncodeLayer(l, /*task_id=*/0, g, residual.data(), &chunks, kMaxChunkBytes),
                IsOk());
    for (size_t i = 0; i < g.size(); ++i) expected[l].push_back(g[i] - residual[i]);
    for (const EncodedChunk& chunk : chunks) {
      ASSERT_THAT(assembler.AddChunk(l, chunk.offset, chunk.payload, chunk.codec), IsOk());
      bytes += chunk.payload.size();
    }
  }
  EXPECT_EQ(assembler.bytes_received(), bytes);
  EXPECT_EQ(
      assembler.bytes_by_codec()[v1::CODEC_LOWRANK] + assembler.bytes_by_codec()[v1::CODEC_BF16],
      bytes);
  // bias as bf16, w's factors (40 + 30) * 3 bf16 and a header; v's (20 + 30) * 3 and a header.
  EXPECT_EQ(bytes, 10 * 2 + (40 + 30) * 3 * 2 + (20 + 30) * 3 * 2 + 2 * kLowRankHeaderBytes);
  absl::StatusOr<PendingUpdate> update = std::move(assembler).Finish();
  ASSERT_THAT(update, IsOk());
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_EQ(update->layers[l].size(), expected[l].size());
    for (size_t i = 0; i < expected[l].size(); ++i) {
      // g - (g - decoded) is decoded up to the rounding of the two subtractions.
      ASSERT_NEAR(update->layers[l][i], expected[l][i], 1e-9f) << l << " " << i;
    }
  }
}

TEST(UpdateAssemblerLowRankTest, ChunksThatDoNotFitTheSpecAreRefusedWithNothingReceived) {
  const v1::ModelSpec spec = Spec();
  const std::vector<float> m = Random(40 * 30, 3);
  absl::StatusOr<LowRankFactors> f = CompressLowRank(m, 40, 30, 4, {}, 1);
  ASSERT_THAT(f, IsOk());
  absl::StatusOr<LowRankEncoding> at_bias =
      EncodeLowRankFactors(*f, 0, v1::CODEC_FP32, 0, kMaxChunkBytes);
  absl::StatusOr<LowRankEncoding> at_w =
      EncodeLowRankFactors(*f, 10, v1::CODEC_FP32, 0, kMaxChunkBytes);
  ASSERT_THAT(at_bias, IsOk());
  ASSERT_THAT(at_w, IsOk());
  v1::PushHeader header;
  UpdateAssembler assembler(spec, header);
  std::string bias;
  ASSERT_THAT(EncodeChunk(v1::CODEC_FP32, Random(10, 4), 0, &bias, nullptr), IsOk());
  // The factors claim the bias's place.
  EXPECT_THAT(assembler.AddChunk(0, 0, at_bias->chunks[0].payload, v1::CODEC_LOWRANK),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 0 (blocks.0): low-rank chunk: the tensor at offset 0 "
                                 "(bias) is not a 40 x 30 matrix")));
  ASSERT_THAT(assembler.AddChunk(0, 0, bias, v1::CODEC_FP32), IsOk());
  // The matrix of blocks.0 sent as head's: head's only tensor is 20 x 30.
  EXPECT_THAT(assembler.AddChunk(1, 0, at_bias->chunks[0].payload, v1::CODEC_LOWRANK),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("wrong size")));
  // A corrupted factor.
  std::string nan = at_w->chunks[0].payload;
  const float bad = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data() + kLowRankHeaderBytes, &bad, sizeof(bad));
  EXPECT_THAT(assembler.AddChunk(0, 10, nan, v1::CODEC_LOWRANK),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 0 (blocks.0) at offset 10: low-rank chunk: factor Q")));
  EXPECT_EQ(assembler.bytes_received(), bias.size());
  // The right chunk still goes in after the refusals.
  ASSERT_THAT(assembler.AddChunk(0, 10, at_w->chunks[0].payload, v1::CODEC_LOWRANK), IsOk());
}

}  // namespace
}  // namespace aloe::server
