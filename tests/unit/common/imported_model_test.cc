#include "common/imported_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ImportedModelTest, LayerNamesFollowTheModuleHierarchy) {
  EXPECT_EQ(LayerNameOf("tok_emb.weight"), "tok_emb");
  EXPECT_EQ(LayerNameOf("blocks.3.attn.qkv.weight"), "blocks.3");
  EXPECT_EQ(LayerNameOf("blocks.3.weight"), "blocks.3");  // a ModuleList of Linear
  EXPECT_EQ(LayerNameOf("encoder.layer.weight"), "encoder");
  EXPECT_EQ(LayerNameOf("scale"), "root");       // a parameter of the root module
  EXPECT_EQ(LayerNameOf("params.0"), "params");  // a ParameterList
  EXPECT_EQ(LayerNameOf("0.weight"), "0");       // the root is a Sequential
  EXPECT_EQ(LayerNameOf("blocks.x1.weight"), "blocks");
}

TEST(ImportedModelTest, GroupsInOrderOfFirstAppearanceWithElementCounts) {
  const std::vector<v1::LayerSpec> layers = GroupIntoLayers({
      {"emb.weight", {256, 32}},
      {"blocks.0.weight", {32, 32}},
      {"blocks.0.bias", {32}},
      {"head.weight", {256, 32}},
      {"emb.scale", {}},  // a scalar, after another layer: joins the emb layer
  });
  ASSERT_EQ(layers.size(), 3u);
  EXPECT_EQ(layers[0].id(), 0u);
  EXPECT_EQ(layers[0].name(), "emb");
  EXPECT_EQ(layers[0].num_elements(), 256u * 32 + 1);
  ASSERT_EQ(layers[0].tensors_size(), 2);
  EXPECT_EQ(layers[0].tensors(1).name(), "emb.scale");
  EXPECT_EQ(layers[0].tensors(1).shape_size(), 0);
  EXPECT_EQ(layers[1].name(), "blocks.0");
  EXPECT_EQ(layers[1].num_elements(), 32u * 32 + 32);
  EXPECT_THAT(std::vector<int64_t>(layers[1].tensors(0).shape().begin(),
                                   layers[1].tensors(0).shape().end()),
              ElementsAre(32, 32));
  EXPECT_EQ(layers[2].id(), 2u);
  EXPECT_EQ(layers[2].name(), "head");
}

v1::ImportedModel SmallModel(v1::ModelOutput output = v1::MODEL_OUTPUT_LOGITS) {
  v1::ImportedModel m;
  m.set_format(1);
  m.set_source("small.pt");
  m.set_vocab_size(256);
  m.set_seq_len(16);
  m.set_output(output);
  for (v1::LayerSpec& layer : GroupIntoLayers(
           {{"emb.weight", {256, 32}}, {"blocks.0.weight", {32, 32}}, {"blocks.0.bias", {32}}})) {
    std::vector<float> values(layer.num_elements());
    for (size_t i = 0; i < values.size(); ++i) values[i] = 0.001f * i - layer.id();
    AppendFloats(values, m.add_layer_params());
    *m.add_layers() = std::move(layer);
  }
  m.set_fingerprint(ModelFingerprint(m));
  return m;
}

TEST(ImportedModelTest, FingerprintIsFnv1aOfTheArchitecture) {
  // Computed independently (Python) as 64-bit FNV-1a of
  // "output=MODEL_OUTPUT_LOGITS;layer=emb:emb.weight[256,32];layer=blocks.0:blocks.0.weight[32,32];blocks.0.bias[32];"
  v1::ImportedModel m = SmallModel();
  EXPECT_EQ(ModelFingerprint(m), "byo1-2a030c36f12f7471");
  EXPECT_EQ(ModelFingerprint(SmallModel(v1::MODEL_OUTPUT_LOSS)), "byo1-6b28086919d3b97e");
  // Data properties, values, the source and the stored fingerprint do not count.
  v1::ImportedModel other = m;
  other.set_vocab_size(1000);
  other.set_seq_len(7);
  other.set_source("elsewhere.pt");
  other.set_fingerprint("x");
  other.mutable_layer_params(0)->assign(other.layer_params(0).size(), '\0');
  EXPECT_EQ(ModelFingerprint(other), ModelFingerprint(m));
  // A shape does.
  other.mutable_layers(1)->mutable_tensors(1)->set_shape(0, 33);
  EXPECT_NE(ModelFingerprint(other), ModelFingerprint(m));
}

TEST(ImportedModelTest, ValidationNamesTheProblem) {
  EXPECT_THAT(ValidateImportedModel(SmallModel()), IsOk());
  struct Case {
    const char* expect;
    std::function<void(v1::ImportedModel*)> mutate;
  };
  const std::vector<Case> cases = {
      {"format 2 is unknown", [](v1::ImportedModel* m) { m->set_format(2); }},
      {"vocab_size must be >= 2", [](v1::ImportedModel* m) { m->set_vocab_size(1); }},
      {"seq_len must be in", [](v1::ImportedModel* m) { m->set_seq_len(0); }},
      {"output must be", [](v1::ImportedModel* m) { m->set_output(v1::MODEL_OUTPUT_UNSPECIFIED); }},
      {"has 2 layers but parameters for 1",
       [](v1::ImportedModel* m) { m->mutable_layer_params()->RemoveLast(); }},
      {"layer 1 \"blocks.0\" has id 5",
       [](v1::ImportedModel* m) { m->mutable_layers(1)->set_id(5); }},
      {"names must be non-empty and unique",
       [](v1::ImportedModel* m) { m->mutable_layers(1)->set_name("emb"); }},
      {"tensor name \"emb.weight\" is empty or not unique",
       [](v1::ImportedModel* m) {
         m->mutable_layers(1)->mutable_tensors(0)->set_name("emb.weight");
       }},
      {"has shape [32,0]",
       [](v1::ImportedModel* m) { m->mutable_layers(1)->mutable_tensors(0)->set_shape(1, 0); }},
      {"has num_elements 7 but its tensors hold 1056",
       [](v1::ImportedModel* m) { m->mutable_layers(1)->set_num_elements(7); }},
      {"parameters are 4220 bytes, expected 4224",
       [](v1::ImportedModel* m) { m->mutable_layer_params(1)->resize(4220); }},
      {"layer 1 \"blocks.0\": non-finite value nan at element 3",
       [](v1::ImportedModel* m) {
         const float nan = std::numeric_limits<float>::quiet_NaN();
         m->mutable_layer_params(1)->replace(12, 4, reinterpret_cast<const char*>(&nan), 4);
       }},
      {"does not match its layers", [](v1::ImportedModel* m) { m->set_fingerprint("byo1-0"); }},
  };
  for (const Case& c : cases) {
    v1::ImportedModel m = SmallModel();
    c.mutate(&m);
    EXPECT_THAT(ValidateImportedModel(m),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.expect)))
        << c.expect;
  }
}

TEST(ImportedModelTest, FileRoundTripAndBadFiles) {
  const std::string path = ::testing::TempDir() + "/small.aloemodel";
  const v1::ImportedModel m = SmallModel();
  ASSERT_THAT(WriteImportedModel(path, m), IsOk());
  absl::StatusOr<v1::ImportedModel> read = ReadImportedModel(path);
  ASSERT_THAT(read, IsOk());
  EXPECT_EQ(read->SerializeAsString(), m.SerializeAsString());

  EXPECT_THAT(ReadImportedModel(path + ".missing"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot open")));
  const std::string garbage = ::testing::TempDir() + "/garbage.aloemodel";
  std::ofstream(garbage) << "this is a token shard, not a model";
  EXPECT_THAT(ReadImportedModel(garbage), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   HasSubstr("not an imported-model file")));
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string truncated = ::testing::TempDir() + "/truncated.aloemodel";
  std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() - 100);
  EXPECT_THAT(ReadImportedModel(truncated),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(truncated)));
  v1::ImportedModel bad = m;
  bad.set_vocab_size(0);
  EXPECT_THAT(WriteImportedModel(path, bad),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(ImportedModelTest, ServerModelFromAFileKeepsItsValuesAndBalancesShards) {
  const std::string path = ::testing::TempDir() + "/server.aloemodel";
  const v1::ImportedModel m = SmallModel();
  ASSERT_THAT(WriteImportedModel(path, m), IsOk());
  v1::ServerConfig config;
  config.set_model_file(path);
  config.set_apply_groups(2);
  absl::StatusOr<ServerModel> model = LoadServerModel(config);
  ASSERT_THAT(model, IsOk());
  EXPECT_EQ(model->fingerprint, "byo1-2a030c36f12f7471");
  EXPECT_EQ(model->vocab_size, 256u);
  EXPECT_EQ(model->seq_len, 16u);
  ASSERT_EQ(model->spec.layers_size(), 2);
  EXPECT_EQ(model->spec.num_shards(), 2u);
  EXPECT_EQ(model->spec.layers(0).shard(), 0u);  // the larger layer first, to shard 0
  EXPECT_EQ(model->spec.layers(1).shard(), 1u);
  ASSERT_EQ(model->initial.size(), 2u);
  ASSERT_EQ(model->initial[1].size(), 32u * 32 + 32);
  EXPECT_FLOAT_EQ(model->initial[1][10], 0.001f * 10 - 1);
  EXPECT_FLOAT_EQ(model->initial[0][0], 0.0f);
  // A shard process builds only its layers; a coordinator none.
  absl::StatusOr<ServerModel> shard1 = LoadServerModel(config, 1);
  ASSERT_THAT(shard1, IsOk());
  ASSERT_EQ(shard1->initial.size(), 2u);
  EXPECT_TRUE(shard1->initial[0].empty());
  EXPECT_EQ(shard1->initial[1], model->initial[1]);
  absl::StatusOr<ServerModel> coordinator = LoadServerModel(config, kNoLayers);
  ASSERT_THAT(coordinator, IsOk());
  EXPECT_TRUE(coordinator->initial.empty());
  EXPECT_EQ(coordinator->spec.SerializeAsString(), model->spec.SerializeAsString());

  config.set_model_file(path + ".missing");
  EXPECT_THAT(LoadServerModel(config),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model_file: ")));
}

// LayerSpec.shard names the shard process owning the layer when there are shard processes,
// the layer's apply group otherwise; the deprecated num_shards reaches the spec through
// apply_groups only.
TEST(ImportedModelTest, LayersGoToShardProcessesElseToApplyGroups) {
  v1::ServerConfig config;
  config.set_corpus_dir("data/sotu");
  config.set_num_shards(3);  // the deprecated name of apply_groups
  FillServerDefaults(&config);
  ASSERT_THAT(ValidateServerConfig(config), IsOk());
  absl::StatusOr<ServerModel> single = LoadServerModel(config, kNoLayers);
  ASSERT_THAT(single, IsOk());
  EXPECT_EQ(single->spec.num_shards(), 3u);

  config.set_shard_processes(5);
  absl::StatusOr<ServerModel> sharded = LoadServerModel(config, kNoLayers);
  ASSERT_THAT(sharded, IsOk());
  EXPECT_EQ(sharded->spec.num_shards(), 5u);
  uint32_t highest = 0;
  for (const v1::LayerSpec& layer : sharded->spec.layers()) {
    highest = std::max(highest, layer.shard());
  }
  EXPECT_EQ(highest, 4u);  // the default model has 6 layers: every process owns one
}

TEST(ImportedModelTest, ConfigTakesModelOrModelFileNotBoth) {
  v1::ServerConfig config;
  config.set_corpus_dir("data/sotu");
  config.set_model_file("m.aloemodel");
  FillServerDefaults(&config);
  EXPECT_FALSE(config.has_model());  // no transformer defaults for an imported model
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  config.mutable_model()->set_d_model(64);
  EXPECT_THAT(ValidateServerConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model and model_file are exclusive")));
}

}  // namespace
}  // namespace aloe
