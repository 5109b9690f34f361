#include "server/core/update_assembler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "tests/testing/pieces.h"

namespace aloe::server {
namespace {

using ::aloe::testing::CutAt;
using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
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
  ASSERT_THAT(
      EncodeChunk(v1::CODEC_INT8_BLOCKWISE, absl::MakeConstSpan(g.data(), 300), 64, &a, nullptr),
      IsOk());
  ASSERT_THAT(
      EncodeChunk(v1::CODEC_FP32, absl::MakeConstSpan(g.data() + 300, 300), 64, &b, nullptr),
      IsOk());
  ASSERT_THAT(
      EncodeChunk(v1::CODEC_BF16, absl::MakeConstSpan(g.data() + 600, 400), 64, &c, nullptr),
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

// Delivers the bytes of values[from, ...) in the pieces AddFp32Read asks for (as a raw push's
// socket reads do), each read going on where the last one stopped.
auto Reader(const std::vector<float>& values, size_t from) {
  auto at = std::make_shared<const char*>(reinterpret_cast<const char*>(values.data() + from));
  return [at](char* to, size_t bytes) {
    std::memcpy(to, *at, bytes);
    *at += bytes;
    return absl::OkStatus();
  };
}

TEST(UpdateAssemblerTest, InPlaceFloat32PiecesAssembleTheLayerAndCountTheBytes) {
  const v1::ModelSpec spec = OneLayer(1000);
  std::vector<float> g(1000);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.25f * static_cast<float>(i) - 100.0f;
  UpdateAssembler assembler(spec, v1::PushHeader());
  // 600 elements in pieces of 70 (the last one 40): the streaming copy's aligned body, its
  // head and its tail, and a piece too short to stream.
  std::vector<char> bounce(70 * sizeof(float));
  ASSERT_THAT(assembler.AddFp32Read(0, 0, 600, absl::MakeSpan(bounce), Reader(g, 0)), IsOk());
  // Out of order and past the end: refused before anything is read.
  bool filled = false;
  auto mark = [&](char*, size_t) {
    filled = true;
    return absl::OkStatus();
  };
  EXPECT_THAT(assembler.AddFp32Read(0, 700, 300, absl::MakeSpan(bounce), mark),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected offset 600")));
  EXPECT_THAT(
      assembler.AddFp32Read(0, 600, 401, absl::MakeSpan(bounce), mark),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the layer's 1000 elements")));
  EXPECT_THAT(assembler.AddFp32Read(1, 0, 1, absl::MakeSpan(bounce), mark),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown layer 1")));
  EXPECT_FALSE(filled);
  // A failing reader's status comes back as it is, and nothing counts as received.
  EXPECT_THAT(assembler.AddFp32Read(
                  0, 600, 400, absl::MakeSpan(bounce),
                  [](char*, size_t) { return absl::UnavailableError("connection closed"); }),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("connection closed")));
  EXPECT_EQ(assembler.bytes_received(), 600 * sizeof(float));
  ASSERT_THAT(assembler.AddFp32Read(0, 600, 400, absl::MakeSpan(bounce), Reader(g, 600)), IsOk());
  EXPECT_EQ(assembler.bytes_received(), 4000u);
  EXPECT_EQ(assembler.bytes_by_codec()[v1::CODEC_FP32], 4000u);
  auto update = std::move(assembler).Finish();
  ASSERT_THAT(update, IsOk());
  EXPECT_EQ(update->layers[0], g);
}

TEST(UpdateAssemblerTest, InPlaceValuesAreScreenedAndTheBadOneIsNamed) {
  const v1::ModelSpec spec = OneLayer(100);
  struct Case {
    float value;
    const char* message;
  };
  const Case cases[] = {
      {std::numeric_limits<float>::quiet_NaN(), "non-finite value nan at element 37"},
      {-std::numeric_limits<float>::infinity(), "non-finite value -inf at element 37"},
      {std::nextafter(kMaxPushMagnitude, 2 * kMaxPushMagnitude),
       "at element 87 exceeds the pseudo-gradient magnitude limit"},
  };
  for (const Case& c : cases) {
    std::vector<float> g(100, 0.5f);
    g[87] = c.value;
    UpdateAssembler assembler(spec, v1::PushHeader());
    // Pieces of 16: the bad value is in the third piece of the second call.
    std::vector<char> bounce(16 * sizeof(float));
    ASSERT_THAT(assembler.AddFp32Read(0, 0, 50, absl::MakeSpan(bounce), Reader(g, 0)), IsOk());
    EXPECT_THAT(assembler.AddFp32Read(0, 50, 50, absl::MakeSpan(bounce), Reader(g, 50)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.value;
    EXPECT_EQ(assembler.bytes_received(), 50 * sizeof(float));
    EXPECT_THAT(std::move(assembler).Finish(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("received 50 of 100")));
  }
}

TEST(UpdateAssemblerTest, InPlaceRefusesAnotherShardsLayerAndFillsASlice) {
  v1::ModelSpec spec = OneLayer(10);
  v1::LayerSpec* second = spec.add_layers();
  second->set_id(1);
  second->set_name("second");
  second->set_num_elements(10);
  second->set_shard(1);
  v1::PushHeader header;
  header.set_slice(1);
  header.set_slices(2);  // elements [5, 10) of each layer
  UpdateAssembler assembler(spec, header, /*only_shard=*/1);
  const std::vector<float> g = {1, 2, 3, 4, 5};
  std::vector<char> bounce(1024);
  EXPECT_THAT(assembler.AddFp32Read(0, 5, 5, absl::MakeSpan(bounce), Reader(g, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("belongs to shard process 0, but this push went to shard "
                                 "process 1")));
  EXPECT_THAT(assembler.AddFp32Read(1, 0, 5, absl::MakeSpan(bounce), Reader(g, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected offset 5")));
  ASSERT_THAT(assembler.AddFp32Read(1, 5, 5, absl::MakeSpan(bounce), Reader(g, 0)), IsOk());
  auto update = std::move(assembler).Finish();
  ASSERT_THAT(update, IsOk());
  EXPECT_TRUE(update->layers[0].empty());
  EXPECT_EQ(update->layers[1], (std::vector<float>{0, 0, 0, 0, 0, 1, 2, 3, 4, 5}));
}

TEST(UpdateAssemblerTest, GroupPushCarriesEveryLayerOfItsGroupAndNoOther) {
  // Layers 0 and 2 form group 0, layer 1 group 1.
  v1::ModelSpec spec = OneLayer(4);
  for (int l = 1; l < 3; ++l) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(l);
    layer->set_name(absl::StrCat("l", l));
    layer->set_num_elements(3);
  }
  const std::vector<uint32_t> groups = {0, 1, 0};
  v1::PushHeader header;
  header.set_group(0);
  header.set_task_continues(true);
  const std::vector<float> four = {1, 2, 3, 4};
  const std::vector<float> three = {5, 6, 7};
  std::string a, b;
  AppendFloats(absl::MakeConstSpan(four), &a);
  AppendFloats(absl::MakeConstSpan(three), &b);
  {
    UpdateAssembler assembler(spec, header, std::nullopt, nullptr, false, groups);
    // Another group's layer is refused, naming both groups; nothing counts as received.
    EXPECT_THAT(assembler.AddChunk(1, 0, b),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("layer 1 (l1) belongs to layer group 1, but this push carries "
                                   "layer group 0")));
    EXPECT_EQ(assembler.bytes_received(), 0u);
    ASSERT_THAT(assembler.AddChunk(0, 0, a), IsOk());
    // Layer 2 of the group is still missing.
    UpdateAssembler copy = assembler;
    EXPECT_THAT(std::move(copy).Finish(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2 (l2) incomplete")));
    ASSERT_THAT(assembler.AddChunk(2, 0, b), IsOk());
    auto update = std::move(assembler).Finish();
    ASSERT_THAT(update, IsOk());
    EXPECT_EQ(update->layers[0], four);
    EXPECT_TRUE(update->layers[1].empty());
    EXPECT_EQ(update->layers[2], three);
    EXPECT_EQ(update->group, 0u);
    EXPECT_TRUE(update->task_continues);
  }
  // A group the model does not have: every layer is refused.
  header.set_group(5);
  UpdateAssembler assembler(spec, header, std::nullopt, nullptr, false, groups);
  EXPECT_THAT(assembler.AddChunk(0, 0, a),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("carries layer group 5")));
  // Without layer groups the same header's layers are all expected.
  header.set_group(0);
  UpdateAssembler whole(spec, header);
  ASSERT_THAT(whole.AddChunk(0, 0, a), IsOk());
  EXPECT_THAT(std::move(whole).Finish(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1 (l1) incomplete")));
}

TEST(UpdateAssemblerTest, MalformedEncodedChunkNamesTheLayerAndCodec) {
  const v1::ModelSpec spec = OneLayer(10);
  UpdateAssembler assembler(spec, v1::PushHeader());
  EXPECT_THAT(assembler.AddChunk(0, 0, std::string(20, 'x'), v1::CODEC_INT8_BLOCKWISE),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("CODEC_INT8_BLOCKWISE")));
  EXPECT_THAT(assembler.AddChunk(0, 0, std::string(3, '\0'), v1::CODEC_BF16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0 (only)")));
}

TEST(UpdateAssemblerTest, Int4ChunksDecodeAndHostileOnesAreRefusedNamingTheProblem) {
  const v1::ModelSpec spec = OneLayer(1001);
  std::vector<float> g(1001);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.001f * static_cast<float>(i) - 0.5f;
  std::string a, b;
  const auto first = absl::MakeConstSpan(g.data(), 640);
  const auto rest = absl::MakeConstSpan(g.data() + 640, 361);  // odd: a padding nibble
  ASSERT_THAT(EncodeChunk(v1::CODEC_INT4_BLOCKWISE, first, 64, &a, nullptr), IsOk());
  ASSERT_THAT(EncodeChunk(v1::CODEC_INT4_BLOCKWISE, rest, 64, &b, nullptr), IsOk());
  v1::PushHeader header;
  header.set_codec(v1::CODEC_INT4_BLOCKWISE);
  {
    UpdateAssembler assembler(spec, header);
    ASSERT_THAT(assembler.AddChunk(0, 0, a), IsOk());
    ASSERT_THAT(assembler.AddChunk(0, 640, b), IsOk());
    EXPECT_EQ(assembler.bytes_received(), a.size() + b.size());
    auto update = std::move(assembler).Finish();
    ASSERT_THAT(update, IsOk());
    // Half a step of each block: its max |g| / 14.
    for (size_t k = 0; k < g.size(); k += 64) {
      float m = 0;
      for (size_t i = k; i < std::min(g.size(), k + 64); ++i) m = std::max(m, std::abs(g[i]));
      for (size_t i = k; i < std::min(g.size(), k + 64); ++i) {
        ASSERT_NEAR(update->layers[0][i], g[i], m / 14 * 1.0001f) << i;
      }
    }
  }
  auto with_scale = [](std::string bytes, size_t block, float scale) {
    bytes.replace(16 + 4 * block, 4, reinterpret_cast<const char*>(&scale), 4);
    return bytes;
  };
  std::string other_n = a;
  other_n[8] = static_cast<char>(other_n[8] + 2);  // n = 642 in a buffer sized for 640
  struct Hostile {
    std::string bytes;
    std::string text;
  };
  const Hostile hostile[] = {
      {a.substr(0, a.size() - 1), "int4 buffer is 375 bytes but its header (n=640"},
      {"AQ8" + a.substr(3), "bad magic"},
      {with_scale(a, 2, std::numeric_limits<float>::quiet_NaN()), "for block 2"},
      {with_scale(a, 9, std::numeric_limits<float>::infinity()), "for block 9"},
      {with_scale(a, 0, -0.25f), "invalid scale -0.25"},
      {other_n, "n=642"},
  };
  for (const Hostile& h : hostile) {
    UpdateAssembler assembler(spec, header);
    EXPECT_THAT(assembler.AddChunk(0, 0, h.bytes),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("layer 0 (only)"), HasSubstr("CODEC_INT4_BLOCKWISE"),
                               HasSubstr(h.text))));
    EXPECT_EQ(assembler.bytes_received(), 0u) << h.text;
  }
  // A well-formed chunk that runs past the layer's end.
  UpdateAssembler assembler(spec, header);
  ASSERT_THAT(assembler.AddChunk(0, 0, a), IsOk());
  std::string too_long;
  ASSERT_THAT(EncodeChunk(v1::CODEC_INT4_BLOCKWISE, absl::MakeConstSpan(g.data(), 362), 64,
                          &too_long, nullptr),
              IsOk());
  EXPECT_THAT(assembler.AddChunk(0, 640, too_long),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("chunk [640, 1002) exceeds the layer's 1001 elements")));
}

TEST(UpdateAssemblerTest, PayloadInPiecesDecodesAsTheWholeWhereverItIsCut) {
  const v1::ModelSpec spec = OneLayer(7);
  const std::vector<float> g = {0.5f, -1.25f, 3e-8f, -0.0f, 1e6f, -7.75f, 2.0f};
  std::string payload;
  AppendFloats(g, &payload);
  // Two and three pieces, values split between pieces, empty pieces, one-byte pieces.
  std::vector<std::vector<size_t>> cuts;
  for (size_t a = 0; a <= payload.size(); ++a) {
    cuts.push_back({a});
    for (size_t b = a; b <= payload.size(); b += 3) cuts.push_back({a, b});
  }
  cuts.push_back({});
  std::vector<size_t> every;
  for (size_t a = 1; a < payload.size(); ++a) every.push_back(a);
  cuts.push_back(every);
  for (const std::vector<size_t>& at : cuts) {
    UpdateAssembler assembler(spec, v1::PushHeader());
    // The first 3 values as one chunk in pieces, the rest as another.
    const std::string_view head = std::string_view(payload).substr(0, 12);
    std::vector<size_t> head_at;
    for (size_t a : at) head_at.push_back(std::min<size_t>(a, 12));
    ASSERT_THAT(assembler.AddChunk(0, 0, absl::MakeConstSpan(CutAt(head, head_at))), IsOk());
    const std::string_view tail = std::string_view(payload).substr(12);
    std::vector<size_t> tail_at;
    for (size_t a : at) tail_at.push_back(a < 12 ? 0 : a - 12);
    ASSERT_THAT(assembler.AddChunk(0, 3, absl::MakeConstSpan(CutAt(tail, tail_at))), IsOk());
    EXPECT_EQ(assembler.bytes_received(), payload.size());
    auto update = std::move(assembler).Finish();
    ASSERT_THAT(update, IsOk());
    ASSERT_EQ(update->layers[0].size(), g.size());
    EXPECT_EQ(std::memcmp(update->layers[0].data(), g.data(), 4 * g.size()), 0);
  }
}

// With sum_squares every layer's sum of squares is measured from the chunks as they arrive,
// whatever way they come: whole float32 chunks, chunks in pieces with values split between
// them, raw reads in pieces, and bf16 (of the decoded values); without, none is.
TEST(UpdateAssemblerTest, SumSquaresMeasuresEachLayerFromItsChunks) {
  v1::ModelSpec spec;
  for (int l = 0; l < 3; ++l) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(l);
    layer->set_name(absl::StrCat("layer", l));
    layer->set_num_elements(500);
  }
  std::vector<std::vector<float>> g(3, std::vector<float>(500));
  for (int l = 0; l < 3; ++l) {
    for (size_t i = 0; i < 500; ++i) {
      g[l][i] = 0.01f * static_cast<float>((i * 7 + l) % 101) - 0.5f;
    }
  }
  for (const bool on : {true, false}) {
    UpdateAssembler assembler(spec, v1::PushHeader(), std::nullopt, nullptr, on);
    // Layer 0: two float32 chunks, the second in pieces cut inside values.
    std::string a, b;
    AppendFloats(absl::MakeConstSpan(g[0].data(), 200), &a);
    AppendFloats(absl::MakeConstSpan(g[0].data() + 200, 300), &b);
    ASSERT_THAT(assembler.AddChunk(0, 0, a), IsOk());
    ASSERT_THAT(assembler.AddChunk(0, 200, absl::MakeConstSpan(CutAt(b, {5, 6, 401, 1199}))),
                IsOk());
    // Layer 1: raw reads in pieces of 70.
    std::vector<char> bounce(70 * sizeof(float));
    ASSERT_THAT(assembler.AddFp32Read(1, 0, 500, absl::MakeSpan(bounce), Reader(g[1], 0)), IsOk());
    // Layer 2: bf16.
    std::string c;
    ASSERT_THAT(EncodeChunk(v1::CODEC_BF16, g[2], 64, &c, nullptr), IsOk());
    ASSERT_THAT(assembler.AddChunk(2, 0, c, v1::CODEC_BF16), IsOk());
    auto update = std::move(assembler).Finish();
    ASSERT_THAT(update, IsOk());
    if (!on) {
      EXPECT_TRUE(update->layer_squares.empty());
      continue;
    }
    ASSERT_EQ(update->layer_squares.size(), 3u);
    for (int l = 0; l < 3; ++l) {
      double expected = 0;  // of what was received: layer 2's bf16-rounded values
      for (float v : update->layers[l]) expected += static_cast<double>(v) * v;
      EXPECT_NEAR(update->layer_squares[l], expected, 1e-5 * expected) << "layer " << l;
    }
    double exact = 0;
    for (float v : g[0]) exact += static_cast<double>(v) * v;
    EXPECT_NEAR(update->layer_squares[0], exact, 1e-5 * exact);
    EXPECT_GT(exact, 1.0);
  }
}

TEST(UpdateAssemblerTest, BadValueSplitBetweenPiecesIsNamed) {
  const v1::ModelSpec spec = OneLayer(4);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), 2e6f}) {
    std::string payload;
    AppendFloats(std::vector<float>{1.0f, 2.0f, bad, 4.0f}, &payload);
    for (size_t a = 0; a <= payload.size(); ++a) {
      UpdateAssembler assembler(spec, v1::PushHeader());
      const absl::Status s = assembler.AddChunk(
          0, 0, absl::MakeConstSpan(CutAt(payload, {a, a + 1 <= payload.size() ? a + 1 : a})));
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                              HasSubstr(std::isnan(bad) ? "non-finite" : "element 2")))
          << "cut at " << a;
      // Refused: the stream may go on with a corrected chunk at the same offset.
      EXPECT_THAT(assembler.AddChunk(0, 0, std::string(16, '\0')), IsOk());
    }
  }
  // A byte count that is not a whole number of floats, and another codec, in pieces.
  UpdateAssembler assembler(spec, v1::PushHeader());
  const std::string odd(15, '\0');
  EXPECT_THAT(assembler.AddChunk(0, 0, absl::MakeConstSpan(CutAt(odd, {5, 9}))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not float32")));
  std::string bf16;
  ASSERT_THAT(EncodeChunk(v1::CODEC_BF16, std::vector<float>{1, 2, 3, 4}, 0, &bf16, nullptr),
              IsOk());
  ASSERT_THAT(assembler.AddChunk(0, 0, absl::MakeConstSpan(CutAt(bf16, {1, 5})), v1::CODEC_BF16),
              IsOk());
  auto update = std::move(assembler).Finish();
  ASSERT_THAT(update, IsOk());
  EXPECT_EQ(update->layers[0], (std::vector<float>{1, 2, 3, 4}));
}

}  // namespace
}  // namespace aloe::server
