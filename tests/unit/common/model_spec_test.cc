#include "common/model_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// V 11, S 5, d 4, L 2, H 2, f = 3 * 4 = 12.
v1::TransformerConfig TinyConfig() {
  v1::TransformerConfig c;
  c.set_vocab_size(11);
  c.set_seq_len(5);
  c.set_d_model(4);
  c.set_num_layers(2);
  c.set_num_heads(2);
  c.set_ffn_mult(3);
  c.set_init_std(0.02f);
  return c;
}

v1::TransformerConfig DefaultConfig() {
  v1::TransformerConfig c;
  FillTransformerDefaults(&c);
  return c;
}

TEST(ModelSpecTest, ElementCountsByHand) {
  const v1::ModelSpec spec = BuildTransformerSpec(TinyConfig(), 1);
  ASSERT_EQ(spec.layers_size(), 4);
  // embed: tok 11*4 + pos 5*4.
  EXPECT_EQ(spec.layers(0).name(), "embed");
  EXPECT_EQ(spec.layers(0).num_elements(), 44u + 20u);
  // block: ln1 4+4, qkv 12*4+12, proj 4*4+4, ln2 4+4, fc1 12*4+12, fc2 4*12+4.
  EXPECT_EQ(spec.layers(1).name(), "blocks.0");
  EXPECT_EQ(spec.layers(1).num_elements(), 8u + 60u + 20u + 8u + 60u + 52u);
  EXPECT_EQ(spec.layers(2).name(), "blocks.1");
  EXPECT_EQ(spec.layers(2).num_elements(), 208u);
  // head: ln_f 4+4, head 11*4.
  EXPECT_EQ(spec.layers(3).name(), "head");
  EXPECT_EQ(spec.layers(3).num_elements(), 8u + 44u);
  EXPECT_EQ(TotalElements(spec), 64u + 2 * 208u + 52u);
  EXPECT_EQ(TransformerParameters(TinyConfig()), 64.0 + 2 * 208.0 + 52.0);
  for (int l = 0; l < spec.layers_size(); ++l) EXPECT_EQ(spec.layers(l).id(), uint32_t(l));
}

TEST(ModelSpecTest, DefaultModelHasThreePointThreeMillionParameters) {
  // embed 256*256 + 128*256; block 4*256*256 + 8*256*1024... counted tensor by tensor:
  // 512 + 196608 + 768 + 65536 + 256 + 512 + 262144 + 1024 + 262144 + 256 = 789760.
  const uint64_t expected = 98304 + 4 * 789760 + (512 + 65536);
  EXPECT_EQ(TotalElements(BuildTransformerSpec(DefaultConfig(), 2)), expected);
  EXPECT_EQ(TransformerParameters(DefaultConfig()), static_cast<double>(expected));
}

// 6 N + 12 L d T by hand. Tiny: 532 parameters less the embeddings' 44 + 20 = 468 multiplied;
// 6 * 468 + 12 * 2 * 4 * 5 = 2808 + 480. Default: 3323392 less 256*256 + 128*256 = 98304;
// 6 * 3225088 + 12 * 4 * 256 * 128 = 19350528 + 1572864. An imported model (no blocks in its
// config): 6 x every parameter, no attention term.
TEST(ModelSpecTest, TrainingFlopsPerTokenByHand) {
  EXPECT_EQ(TrainingFlopsPerToken(BuildTransformerSpec(TinyConfig(), 1), TinyConfig()), 3288.0);
  EXPECT_EQ(TrainingFlopsPerToken(BuildTransformerSpec(DefaultConfig(), 2), DefaultConfig()),
            20923392.0);
  v1::TransformerConfig imported;
  imported.set_vocab_size(11);
  imported.set_seq_len(5);
  EXPECT_EQ(TrainingFlopsPerToken(BuildTransformerSpec(TinyConfig(), 1), imported), 3192.0);
}

TEST(ModelSpecTest, TensorNamesShapesAndInitKinds) {
  const v1::ModelSpec spec = BuildTransformerSpec(TinyConfig(), 1);
  std::vector<std::string> names;
  for (const auto& t : spec.layers(1).tensors()) names.push_back(t.name());
  EXPECT_THAT(
      names,
      ElementsAre("blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.qkv.weight",
                  "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
                  "blocks.0.ln2.weight", "blocks.0.ln2.bias", "blocks.0.mlp.fc1.weight",
                  "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight", "blocks.0.mlp.fc2.bias"));
  const auto& qkv = spec.layers(1).tensors(2);
  EXPECT_THAT(qkv.shape(), ElementsAre(12, 4));
  EXPECT_EQ(qkv.init(), v1::INIT_NORMAL);
  EXPECT_FLOAT_EQ(qkv.init_std(), 0.02f);
  const auto& proj = spec.layers(1).tensors(4);
  EXPECT_FLOAT_EQ(proj.init_std(), 0.02f / 2.0f);                       // 1/sqrt(2L), L = 2
  EXPECT_THAT(spec.layers(1).tensors(10).shape(), ElementsAre(4, 12));  // fc2
  EXPECT_EQ(spec.layers(1).tensors(0).init(), v1::INIT_ONES);
  EXPECT_EQ(spec.layers(1).tensors(1).init(), v1::INIT_ZEROS);
  const auto& head = spec.layers(3);
  ASSERT_EQ(head.tensors_size(), 3);
  EXPECT_EQ(head.tensors(0).name(), "ln_f.weight");
  EXPECT_EQ(head.tensors(2).name(), "head.weight");
  EXPECT_THAT(head.tensors(2).shape(), ElementsAre(11, 4));
  EXPECT_EQ(spec.layers(0).tensors(1).name(), "pos_emb.weight");
  EXPECT_THAT(spec.layers(0).tensors(1).shape(), ElementsAre(5, 4));
}

TEST(ModelSpecTest, ShardsAssignedLargestFirstToLeastLoaded) {
  // Sizes: embed 64, blocks.0 208, blocks.1 208, head 52. blocks.0 -> 0, blocks.1 -> 1,
  // embed -> 0 (tie, lower index), head -> 1 (208 < 272).
  const v1::ModelSpec spec = BuildTransformerSpec(TinyConfig(), 2);
  EXPECT_EQ(spec.num_shards(), 2u);
  EXPECT_EQ(spec.layers(0).shard(), 0u);
  EXPECT_EQ(spec.layers(1).shard(), 0u);
  EXPECT_EQ(spec.layers(2).shard(), 1u);
  EXPECT_EQ(spec.layers(3).shard(), 1u);
  EXPECT_EQ(BuildTransformerSpec(TinyConfig(), 0).num_shards(), 1u);
}

TEST(ModelSpecTest, ShardLoadsDifferByAtMostTheLargestLayer) {
  v1::TransformerConfig c = DefaultConfig();
  c.set_num_layers(7);
  for (uint32_t shards : {1u, 2u, 3u, 4u, 9u}) {
    const v1::ModelSpec spec = BuildTransformerSpec(c, shards);
    std::vector<uint64_t> load(shards, 0);
    uint64_t largest = 0;
    for (const auto& layer : spec.layers()) {
      ASSERT_LT(layer.shard(), shards);
      load[layer.shard()] += layer.num_elements();
      largest = std::max<uint64_t>(largest, layer.num_elements());
    }
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    EXPECT_LE(*hi - *lo, largest) << shards << " shards";
    // Deterministic.
    EXPECT_EQ(BuildTransformerSpec(c, shards).SerializeAsString(), spec.SerializeAsString());
  }
}

TEST(ModelSpecTest, InitializationIsDeterministicAndFollowsInitKinds) {
  v1::TransformerConfig c = DefaultConfig();
  c.set_num_layers(2);
  const v1::ModelSpec spec = BuildTransformerSpec(c, 2);
  const auto a = InitializeParameters(spec, 42);
  const auto b = InitializeParameters(spec, 42);
  const auto other = InitializeParameters(spec, 43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  ASSERT_EQ(a.size(), 4u);
  // One shard process's layers alone: the same values, the other layers empty.
  for (int64_t shard : {0, 1}) {
    const auto mine = InitializeParameters(spec, 42, shard);
    ASSERT_EQ(mine.size(), a.size());
    for (int l = 0; l < spec.layers_size(); ++l) {
      EXPECT_EQ(mine[l], spec.layers(l).shard() == shard ? a[l] : std::vector<float>())
          << "shard process " << shard << " layer " << l;
    }
  }
  for (int l = 0; l < spec.layers_size(); ++l) {
    ASSERT_EQ(a[l].size(), spec.layers(l).num_elements());
    size_t offset = 0;
    for (const auto& t : spec.layers(l).tensors()) {
      size_t n = 1;
      for (int64_t d : t.shape()) n *= d;
      const float* p = a[l].data() + offset;
      offset += n;
      if (t.init() == v1::INIT_ONES) {
        EXPECT_TRUE(std::all_of(p, p + n, [](float x) { return x == 1.0f; })) << t.name();
      } else if (t.init() == v1::INIT_ZEROS) {
        EXPECT_TRUE(std::all_of(p, p + n, [](float x) { return x == 0.0f; })) << t.name();
      } else {
        double sum = 0, sum_sq = 0;
        for (size_t i = 0; i < n; ++i) {
          sum += p[i];
          sum_sq += double(p[i]) * p[i];
        }
        const double mean = sum / n;
        const double sd = std::sqrt(sum_sq / n - mean * mean);
        // n >= 32768 here: the sample sd is within ~1% of init_std; allow 5%.
        EXPECT_NEAR(sd, t.init_std(), 0.05 * t.init_std()) << t.name();
        EXPECT_NEAR(mean, 0.0, 0.05 * t.init_std()) << t.name();
      }
    }
  }
}

TEST(ModelSpecTest, FillDefaults) {
  v1::TransformerConfig c;
  c.set_d_model(64);
  FillTransformerDefaults(&c);
  EXPECT_EQ(c.vocab_size(), 256u);
  EXPECT_EQ(c.seq_len(), 128u);
  EXPECT_EQ(c.d_model(), 64u);
  EXPECT_EQ(c.num_layers(), 4u);
  EXPECT_EQ(c.num_heads(), 4u);
  EXPECT_EQ(c.ffn_mult(), 4u);
  EXPECT_FLOAT_EQ(c.init_std(), 0.02f);
  EXPECT_THAT(ValidateTransformerConfig(c), IsOk());
}

TEST(ModelSpecTest, ValidationNamesTheField) {
  v1::TransformerConfig c = TinyConfig();
  c.set_num_heads(3);  // does not divide 4
  EXPECT_THAT(ValidateTransformerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.num_heads")));
  c = TinyConfig();
  c.set_vocab_size(0);
  EXPECT_THAT(ValidateTransformerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.vocab_size")));
  c = TinyConfig();
  c.set_ffn_mult(0);
  EXPECT_THAT(ValidateTransformerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.ffn_mult")));
  c = TinyConfig();
  c.set_init_std(-0.1f);
  EXPECT_THAT(ValidateTransformerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.init_std")));
}

// Found by the config fuzzer: a config that validated could describe billions of layers, and
// the server died allocating it. Sizes are bounded; the limit is inclusive.
TEST(ModelSpecTest, AbsurdSizesAreConfigErrors) {
  v1::TransformerConfig c = TinyConfig();
  c.set_num_layers(4000000000u);
  EXPECT_THAT(ValidateTransformerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.num_layers")));
  c.set_num_layers(kMaxTransformerBlocks);
  EXPECT_THAT(ValidateTransformerConfig(c), IsOk());
  c = TinyConfig();
  c.set_vocab_size(4000000000u);
  c.set_d_model(1u << 20);
  c.set_num_heads(1);
  // (V + S) d + L (4 d^2 + 2 f d + 8 d + f) + 2 d + V d with d = 2^20: about 8.4e15.
  EXPECT_GT(TransformerParameters(c), 8e15);
  EXPECT_THAT(ValidateTransformerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameters")));
}

}  // namespace
}  // namespace aloe
