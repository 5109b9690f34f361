// ServerCore with a bring-your-own model (ServerConfig.model_file): version 0 is the file's
// parameters, joins must present the model's fingerprint, the join reply carries the data shape,
// and checkpoints of another model are refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/config.h"
#include "common/executor.h"
#include "common/imported_model.h"
#include "common/metrics.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "server/core/server_core.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

// A 2-layer imported model: "emb" (64 x 8) and "head" (8 x 64 + 64); parameter i of layer l is
// 0.01 * i + l.
std::string WriteModel(const std::string& name) {
  v1::ImportedModel m;
  m.set_format(1);
  m.set_vocab_size(64);
  m.set_seq_len(12);
  m.set_output(v1::MODEL_OUTPUT_LOGITS);
  for (v1::LayerSpec& layer :
       GroupIntoLayers({{"emb.weight", {64, 8}}, {"head.weight", {64, 8}}, {"head.bias", {64}}})) {
    std::vector<float> values(layer.num_elements());
    for (size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * i + layer.id();
    AppendFloats(values, m.add_layer_params());
    *m.add_layers() = std::move(layer);
  }
  m.set_fingerprint(ModelFingerprint(m));
  const std::string path = ::testing::TempDir() + "/" + name;
  EXPECT_THAT(WriteImportedModel(path, m), IsOk());
  return path;
}

class ImportedModelCoreTest : public ::testing::Test {
 protected:
  absl::StatusOr<std::unique_ptr<ServerCore>> Make(const std::string& model_file) {
    v1::ServerConfig config;
    config.set_model_file(model_file);
    config.set_corpus_dir("unused");
    config.set_local_steps(5);
    config.mutable_outer_optimizer()->set_type(v1::OUTER_SGD);
    FillServerDefaults(&config);
    EXPECT_THAT(ValidateServerConfig(config), IsOk());
    return ServerCore::Create(config, {{"a", "a.tok", 1000}}, "heldout.tok", clock_, executor_,
                              metrics_);
  }
  static v1::JoinRequest Request(const std::string& fingerprint) {
    v1::JoinRequest request;
    request.set_name("w");
    request.set_role(v1::ROLE_TRAINER);
    request.set_model_fingerprint(fingerprint);
    return request;
  }

  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
};

TEST_F(ImportedModelCoreTest, ServesTheFileAndChecksTheFingerprintAtJoin) {
  auto core = Make(WriteModel("core.aloemodel"));
  ASSERT_THAT(core, IsOk());
  absl::StatusOr<v1::ImportedModel> file =
      ReadImportedModel(::testing::TempDir() + "/core.aloemodel");
  ASSERT_THAT(file, IsOk());
  const std::string fingerprint = file->fingerprint();
  // Layers balanced over the default 2 shards; version 0 is the file's values.
  EXPECT_EQ((*core)->spec().layers(0).name(), "emb");
  EXPECT_EQ((*core)->spec().layers(1).num_elements(), 64u * 8 + 64);
  EXPECT_EQ((*core)->spec().layers(1).shard(), 0u);  // the larger layer goes first, to shard 0
  EXPECT_EQ((*core)->spec().layers(0).shard(), 1u);
  const ModelSnapshot snapshot = (*core)->Snapshot();
  EXPECT_FLOAT_EQ((*snapshot.layers[1])[3], 0.03f + 1);

  // The built-in transformer and another model are refused, naming the fix.
  EXPECT_THAT((*core)->Join(Request("")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("has the built-in transformer: start it with --torchscript")));
  EXPECT_THAT((*core)->Join(Request("byo1-0000000000000000")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("brings another model (fingerprint byo1-0000000000000000)")));

  absl::StatusOr<v1::JoinReply> reply = (*core)->Join(Request(fingerprint));
  ASSERT_THAT(reply, IsOk());
  EXPECT_EQ(reply->model_fingerprint(), fingerprint);
  EXPECT_EQ(reply->model().vocab_size(), 64u);
  EXPECT_EQ(reply->model().seq_len(), 12u);
  EXPECT_EQ(reply->model().d_model(), 0u);  // no transformer
  EXPECT_EQ(reply->model_spec().layers_size(), 2);
}

TEST_F(ImportedModelCoreTest, BuiltInServerRefusesABringYourOwnWorker) {
  v1::ServerConfig config;
  config.set_corpus_dir("unused");
  FillServerDefaults(&config);
  auto core = ServerCore::Create(config, {{"a", "a.tok", 1000}}, "heldout.tok", clock_, executor_,
                                 metrics_);
  ASSERT_THAT(core, IsOk());
  EXPECT_THAT((*core)->Join(Request("byo1-0123456789abcdef")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("trains the built-in transformer")));
  absl::StatusOr<v1::JoinReply> reply = (*core)->Join(Request(""));
  ASSERT_THAT(reply, IsOk());
  EXPECT_EQ(reply->model_fingerprint(), "");
}

TEST_F(ImportedModelCoreTest, MissingOrCorruptModelFileIsAStartupError) {
  EXPECT_THAT(Make(::testing::TempDir() + "/nope.aloemodel"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model_file: ")));
  const std::string path = WriteModel("corrupt.aloemodel");
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  EXPECT_THAT(Make(path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated or corrupt")));
}

TEST_F(ImportedModelCoreTest, CheckpointOfTheBuiltInModelIsRefused) {
  auto imported = Make(WriteModel("ckpt.aloemodel"));
  ASSERT_THAT(imported, IsOk());
  v1::ServerConfig config;
  config.set_corpus_dir("unused");
  config.set_local_steps(5);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_SGD);
  FillServerDefaults(&config);
  auto builtin = ServerCore::Create(config, {{"a", "a.tok", 1000}}, "heldout.tok", clock_,
                                    executor_, metrics_);
  ASSERT_THAT(builtin, IsOk());
  EXPECT_THAT((*imported)->RestoreCheckpoint((*builtin)->CaptureCheckpoint()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another model")));
  EXPECT_THAT((*imported)->RestoreCheckpoint((*imported)->CaptureCheckpoint()), IsOk());
}

}  // namespace
}  // namespace aloe::server
