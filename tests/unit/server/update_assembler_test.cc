#include "server/core/update_assembler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"
#include "common/tensor_codec.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

v1::ModelSpec OneLayer(uint64_t n) {
  v1::ModelSpec spec;
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_id(0);
  layer->set_name("only");
  layer->set_num_elements(n);
  return spec;
}

TEST(UpdateAssemblerTest, MixedCodecChunksOfOneLayerDecodeInPlace) {
  const v1::ModelSpec spec = OneLayer(1000);
  std::vector<float> g(1000);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.001f * static_cast<float>(i) - 0.5f;
  v1::PushHeader header;
  header.set_codec(v1::CODEC_BF16);  // default for chunks that do not say
  UpdateAssembler assembler(spec, header);
  std::string a, b, c;
  ASSERT_THAT(EncodeChunk(v1::CODEC_INT8_BLOCKWISE, absl::MakeConstSpan(g.data(), 300), 64, &a,
                          nullptr),
              IsOk());
  ASSERT_THAT(EncodeChunk(v1::CODEC_FP32, absl::MakeConstSpan(g.data() + 300, 300), 64, &b,
                          nullptr),
              IsOk());
  ASSERT_THAT(EncodeChunk(v1::CODEC_BF16, absl::MakeConstSpan(g.data() + 600, 400), 64, &c,
                          nullptr),
              IsOk());
  ASSERT_THAT(assembler.AddChunk(0, 0, a, v1::CODEC_INT8_BLOCKWISE), IsOk());
  // Out of order: the next chunk must start at 300.
  EXPECT_THAT(assembler.AddChunk(0, 600, c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected offset 300")));
  ASSERT_THAT(assembler.AddChunk(0, 300, b, v1::CODEC_FP32), IsOk());
  ASSERT_THAT(assembler.AddChunk(0, 600, c), IsOk());  // header codec: bf16
  EXPECT_EQ(assembler.bytes_received(), a.size() + b.size() + c.size());
  auto update = std::move(assembler).Finish();
  ASSERT_THAT(update, IsOk());
  const std::vector<float>& got = update->layers[0];
  for (size_t i = 300; i < 600; ++i) ASSERT_EQ(got[i], g[i]);  // fp32 exact
  for (size_t i = 0; i < 300; ++i) ASSERT_NEAR(got[i], g[i], 0.5f / 254 * 1.001f);
  for (size_t i = 600; i < 1000; ++i) ASSERT_NEAR(got[i], g[i], std::abs(g[i]) / 256 + 1e-9f);
}

TEST(UpdateAssemblerTest, MalformedEncodedChunkNamesTheLayerAndCodec) {
  const v1::ModelSpec spec = OneLayer(10);
  UpdateAssembler assembler(spec, v1::PushHeader());
  EXPECT_THAT(assembler.AddChunk(0, 0, std::string(20, 'x'), v1::CODEC_INT8_BLOCKWISE),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CODEC_INT8_BLOCKWISE")));
  EXPECT_THAT(assembler.AddChunk(0, 0, std::string(3, '\0'), v1::CODEC_BF16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0 (only)")));
}

}  // namespace
}  // namespace aloe::server
