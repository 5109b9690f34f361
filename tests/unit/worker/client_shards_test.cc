// ServerClient against a layer-sharded server: in-process fake shard processes on loopback ports
// chosen by the OS record what each receives and answer what the test sets.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/raw_push.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "tests/testing/loopback_server.h"
#include "tests/testing/subprocess.h"
#include "worker/client.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Layers = std::vector<std::vector<float>>;

// A ParameterService that records every push and answers pulls with preset chunks.
class FakeParameterService final : public v1::ParameterService::Service {
 public:
  void SetPushAnswer(const grpc::Status& status, const v1::PushReply& reply) {
    absl::MutexLock lock(&mu_);
    push_status_ = status;
    push_reply_ = reply;
  }
  void SetPullChunks(std::vector<v1::ParamChunk> chunks) {
    absl::MutexLock lock(&mu_);
    pull_chunks_ = std::move(chunks);
  }
  // What a pull of exactly `version` (latest = false) gets instead of the preset chunks.
  void SetPullChunksAt(uint64_t version, std::vector<v1::ParamChunk> chunks) {
    absl::MutexLock lock(&mu_);
    pull_chunks_at_[version] = std::move(chunks);
  }
  std::vector<v1::PullRequest> PullRequests() const {
    absl::MutexLock lock(&mu_);
    return pull_requests_;
  }
  // The messages of every push stream received, in arrival order.
  std::vector<std::vector<v1::PushChunk>> Pushes() const {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }
  int Pulls() const {
    absl::MutexLock lock(&mu_);
    return pulls_;
  }

  grpc::Status Push(grpc::ServerContext*, grpc::ServerReader<v1::PushChunk>* reader,
                    v1::PushReply* reply) override {
    std::vector<v1::PushChunk> stream;
    v1::PushChunk chunk;
    while (reader->Read(&chunk)) stream.push_back(chunk);
    absl::MutexLock lock(&mu_);
    pushes_.push_back(std::move(stream));
    *reply = push_reply_;
    return push_status_;
  }

  grpc::Status Pull(grpc::ServerContext*, const v1::PullRequest* request,
                    grpc::ServerWriter<v1::ParamChunk>* writer) override {
    std::vector<v1::ParamChunk> chunks;
    {
      absl::MutexLock lock(&mu_);
      ++pulls_;
      pull_requests_.push_back(*request);
      auto at = pull_chunks_at_.find(request->version());
      chunks = !request->latest() && at != pull_chunks_at_.end() ? at->second : pull_chunks_;
    }
    for (const v1::ParamChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;
    }
    return grpc::Status::OK;
  }

 private:
  mutable absl::Mutex mu_;
  grpc::Status push_status_ ABSL_GUARDED_BY(mu_);
  v1::PushReply push_reply_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ParamChunk> pull_chunks_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<v1::ParamChunk>> pull_chunks_at_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::PullRequest> pull_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<v1::PushChunk>> pushes_ ABSL_GUARDED_BY(mu_);
  int pulls_ ABSL_GUARDED_BY(mu_) = 0;
};

// A fake served on 127.0.0.1 at a port the OS chose.
struct FakeServer {
  FakeParameterService service;
  ::aloe::testing::LoopbackServer loopback{&service};
  const std::string& address = loopback.address();
};

// Three layers, owned by shards 0, 1, 0; layer 1 takes two chunks.
v1::ModelSpec Spec() {
  v1::ModelSpec spec;
  spec.set_num_shards(2);
  const uint64_t sizes[] = {10, kMaxChunkFloats + 100, 5};
  const uint32_t owners[] = {0, 1, 0};
  for (uint32_t l = 0; l < 3; ++l) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(l);
    layer->set_num_elements(sizes[l]);
    layer->set_shard(owners[l]);
  }
  return spec;
}

// Distinct exactly representable values per layer and element.
Layers Values(const v1::ModelSpec& spec) {
  Layers layers;
  for (const v1::LayerSpec& layer : spec.layers()) {
    std::vector<float> v(layer.num_elements());
    for (size_t j = 0; j < v.size(); ++j) v[j] = 1000.0f * layer.id() + 0.5f * (j % 1000);
    layers.push_back(std::move(v));
  }
  return layers;
}

uint64_t PayloadBytes(const v1::ModelSpec& spec) {
  uint64_t n = 0;
  for (const v1::LayerSpec& layer : spec.layers()) n += layer.num_elements() * sizeof(float);
  return n;
}

// The Pull chunks of one layer at `version`.
std::vector<v1::ParamChunk> LayerChunks(uint32_t id, const std::vector<float>& values,
                                        uint64_t version) {
  std::vector<v1::ParamChunk> chunks;
  for (auto [begin, end] : ChunkRanges(values.size())) {
    v1::ParamChunk chunk;
    chunk.set_version(version);
    chunk.set_layer_id(id);
    chunk.set_offset(begin);
    chunk.set_layer_elements(values.size());
    AppendFloats(absl::MakeConstSpan(values.data() + begin, end - begin), chunk.mutable_data());
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

std::vector<v1::ParamChunk> Concat(std::vector<v1::ParamChunk> a,
                                   const std::vector<v1::ParamChunk>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

v1::PushHeader Header() {
  v1::PushHeader header;
  header.set_worker_id(3);
  header.set_task_id(11);
  header.set_update_id(2);
  header.set_base_version(6);
  header.set_steps_done(50);
  header.set_codec(v1::CODEC_FP32);
  return header;
}

v1::PushReply Reply(bool staged, uint64_t version, uint32_t slices_received = 0) {
  v1::PushReply reply;
  reply.set_staged(staged);
  reply.set_version(version);
  reply.set_slices_received(slices_received);
  reply.set_applied(!staged);
  return reply;
}

// One push stream decoded: layer id -> values (chunks appended at their offsets).
std::map<uint32_t, std::vector<float>> Decode(const std::vector<v1::PushChunk>& stream,
                                              const v1::ModelSpec& spec) {
  std::map<uint32_t, std::vector<float>> layers;
  for (const v1::PushChunk& chunk : stream) {
    if (chunk.data().empty()) continue;
    std::vector<float>& layer = layers[chunk.layer_id()];
    layer.resize(spec.layers(chunk.layer_id()).num_elements());
    absl::StatusOr<size_t> count = EncodedElementCount(chunk.codec(), chunk.data());
    EXPECT_THAT(count, IsOk());
    EXPECT_THAT(DecodeChunk(chunk.codec(), chunk.data(),
                            absl::MakeSpan(layer.data() + chunk.offset(), *count)),
                IsOk());
  }
  return layers;
}

ClientOptions Plaintext(const std::string& address) {
  ClientOptions options;
  options.address = address;
  return options;
}

class ClientShardsTest : public ::testing::Test {
 protected:
  ClientShardsTest() : client_(Plaintext(main_.address)) {
    EXPECT_THAT(client_.SetShards({shards_[0].address, shards_[1].address}), IsOk());
  }

  absl::StatusOr<v1::PushReply> Push(uint64_t* bytes) {
    return client_.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, bytes);
  }

  // Every shard serves the layers it owns: shard 0 at version v0, shard 1 at version v1.
  void ServeOwnLayers(uint64_t v0, uint64_t v1) {
    const Layers values = Values(spec_);
    shards_[0].service.SetPullChunks(
        Concat(LayerChunks(0, values[0], v0), LayerChunks(2, values[2], v0)));
    shards_[1].service.SetPullChunks(LayerChunks(1, values[1], v1));
  }

  FakeServer main_;
  FakeServer shards_[2];
  ServerClient client_;
  const v1::ModelSpec spec_ = Spec();
};

TEST_F(ClientShardsTest, PushSendsEveryShardExactlyItsLayersUnderTheSameHeader) {
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 6));
  shards_[1].service.SetPushAnswer(grpc::Status::OK, Reply(false, 7));
  uint64_t bytes = 0;
  ASSERT_THAT(Push(&bytes), IsOk());
  EXPECT_EQ(bytes, PayloadBytes(spec_));
  EXPECT_TRUE(main_.service.Pushes().empty());
  const Layers values = Values(spec_);
  const std::vector<uint32_t> owned[2] = {{0, 2}, {1}};
  for (int s = 0; s < 2; ++s) {
    SCOPED_TRACE(s);
    const std::vector<std::vector<v1::PushChunk>> pushes = shards_[s].service.Pushes();
    ASSERT_EQ(pushes.size(), 1u);
    const std::vector<v1::PushChunk>& stream = pushes[0];
    ASSERT_FALSE(stream.empty());
    EXPECT_EQ(stream[0].header().SerializeAsString(), Header().SerializeAsString());
    for (size_t i = 1; i < stream.size(); ++i) EXPECT_FALSE(stream[i].has_header());
    const std::map<uint32_t, std::vector<float>> got = Decode(stream, spec_);
    ASSERT_EQ(got.size(), owned[s].size());
    for (uint32_t id : owned[s]) {
      ASSERT_TRUE(got.count(id)) << "layer " << id;
      EXPECT_EQ(got.at(id), values[id]) << "layer " << id;
    }
  }
  EXPECT_EQ(shards_[1].service.Pushes()[0].size(), 2u);  // layer 1 in two chunks
}

TEST_F(ClientShardsTest, TheShardThatCompletedTheUpdateGivesTheReply) {
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(false, 9));
  shards_[1].service.SetPushAnswer(grpc::Status::OK, Reply(true, 8, 1));
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply = Push(&bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_FALSE(reply->staged());
  EXPECT_TRUE(reply->applied());
  EXPECT_EQ(reply->version(), 9u);
}

TEST_F(ClientShardsTest, AllShardsStagedIsStagedWithTheLeastSlicesAndTheNewestVersion) {
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 5, 2));
  shards_[1].service.SetPushAnswer(grpc::Status::OK, Reply(true, 4, 1));
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply = Push(&bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_TRUE(reply->staged());
  EXPECT_FALSE(reply->applied());
  EXPECT_EQ(reply->slices_received(), 1u);
  EXPECT_EQ(reply->version(), 5u);
}

TEST_F(ClientShardsTest, AShardErrorIsThePushError) {
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(false, 9));
  shards_[1].service.SetPushAnswer(
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "base version too stale"),
      v1::PushReply());
  uint64_t bytes = 0;
  EXPECT_THAT(Push(&bytes), StatusIs(absl::StatusCode::kFailedPrecondition,
                                     AllOf(HasSubstr("shard 1"), HasSubstr("too stale"))));
}

TEST_F(ClientShardsTest, TheFirstShardErrorWins) {
  shards_[0].service.SetPushAnswer(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker"),
                                   v1::PushReply());
  shards_[1].service.SetPushAnswer(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "stale"),
                                   v1::PushReply());
  uint64_t bytes = 0;
  EXPECT_THAT(Push(&bytes), StatusIs(absl::StatusCode::kNotFound,
                                     AllOf(HasSubstr("shard 0"), HasSubstr("unknown worker"))));
}

TEST_F(ClientShardsTest, AShardWithoutChunksStillGetsTheHeader) {
  // Layer 1 is empty: shard 1 has nothing to send but must still learn of the update.
  v1::ModelSpec spec = spec_;
  spec.mutable_layers(1)->set_num_elements(0);
  Layers values = Values(spec);
  uint64_t bytes = 0;
  ASSERT_THAT(client_.Push(Header(), spec, values, {}, 256, nullptr, &bytes), IsOk());
  const std::vector<std::vector<v1::PushChunk>> pushes = shards_[1].service.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  ASSERT_EQ(pushes[0].size(), 1u);
  EXPECT_EQ(pushes[0][0].header().SerializeAsString(), Header().SerializeAsString());
  EXPECT_TRUE(pushes[0][0].data().empty());
}

TEST_F(ClientShardsTest, ALayerOfAShardThatDoesNotExistSendsNothing) {
  v1::ModelSpec spec = spec_;
  spec.mutable_layers(2)->set_shard(2);
  uint64_t bytes = 0;
  EXPECT_THAT(client_.Push(Header(), spec, Values(spec), {}, 256, nullptr, &bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2")));
  EXPECT_TRUE(shards_[0].service.Pushes().empty());
  EXPECT_TRUE(shards_[1].service.Pushes().empty());
  Layers layers;
  EXPECT_THAT(client_.Pull(3, 6, false, spec, &layers, &bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2")));
  EXPECT_EQ(shards_[0].service.Pulls(), 0);
}

TEST_F(ClientShardsTest, PullAssemblesTheLayersOfAllShards) {
  ServeOwnLayers(7, 7);
  Layers layers;
  uint64_t bytes = 0;
  absl::StatusOr<uint64_t> version = client_.Pull(3, 7, false, spec_, &layers, &bytes);
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 7u);
  EXPECT_EQ(layers, Values(spec_));
  EXPECT_EQ(bytes, PayloadBytes(spec_));
  EXPECT_EQ(main_.service.Pulls(), 0);
}

TEST_F(ClientShardsTest, AShardSendingAnotherShardsLayerIsDataLoss) {
  const Layers values = Values(spec_);
  shards_[0].service.SetPullChunks(
      Concat(Concat(LayerChunks(0, values[0], 7), LayerChunks(1, values[1], 7)),
             LayerChunks(2, values[2], 7)));
  shards_[1].service.SetPullChunks(LayerChunks(1, values[1], 7));
  Layers layers;
  uint64_t bytes = 0;
  EXPECT_THAT(client_.Pull(3, 7, false, spec_, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("shard 0"), HasSubstr("layer 1 belongs to shard 1"))));
}

TEST_F(ClientShardsTest, ShardsDisagreeingOnTheVersionIsDataLoss) {
  ServeOwnLayers(7, 8);
  Layers layers;
  uint64_t bytes = 0;
  EXPECT_THAT(client_.Pull(3, 7, false, spec_, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shards sent versions 7 and 8")));
  // For the latest, shard 0 is asked for version 8 again, and still sends 7.
  EXPECT_THAT(client_.Pull(3, 0, true, spec_, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shards sent versions 7 and 8")));
}

TEST_F(ClientShardsTest, LatestPullsAShardCaughtBeforeItsCommitAgainAtTheNewerVersion) {
  // Shard 1 applied version 8; shard 0's latest is still 7 and has 8 once asked for it.
  ServeOwnLayers(7, 8);
  Layers newer = Values(spec_);
  for (auto& layer : newer) {
    for (float& v : layer) v += 1.0f;
  }
  shards_[0].service.SetPullChunksAt(
      8, Concat(LayerChunks(0, newer[0], 8), LayerChunks(2, newer[2], 8)));
  Layers layers;
  uint64_t bytes = 0;
  absl::StatusOr<uint64_t> version = client_.Pull(3, 0, true, spec_, &layers, &bytes);
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 8u);
  const Layers values = Values(spec_);
  EXPECT_EQ(layers[0], newer[0]);
  EXPECT_EQ(layers[1], values[1]);  // shard 1's own, at version 8 from the start
  EXPECT_EQ(layers[2], newer[2]);
  const std::vector<v1::PullRequest> asked = shards_[0].service.PullRequests();
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_TRUE(asked[0].latest());
  EXPECT_FALSE(asked[1].latest());
  EXPECT_EQ(asked[1].version(), 8u);
  EXPECT_EQ(shards_[1].service.Pulls(), 1);
  // Every float received counts, the discarded version-7 stream too.
  EXPECT_EQ(bytes, 2 * (values[0].size() + values[2].size()) * sizeof(float) +
                       values[1].size() * sizeof(float));
}

TEST_F(ClientShardsTest, AShardMissingALayerIsDataLoss) {
  const Layers values = Values(spec_);
  shards_[0].service.SetPullChunks(LayerChunks(0, values[0], 7));  // no layer 2
  shards_[1].service.SetPullChunks(LayerChunks(1, values[1], 7));
  Layers layers;
  uint64_t bytes = 0;
  EXPECT_THAT(client_.Pull(3, 7, false, spec_, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("layer 2 incomplete")));
}

TEST_F(ClientShardsTest, NoShardsGoesToTheMainAddress) {
  ASSERT_THAT(client_.SetShards({}), IsOk());
  main_.service.SetPushAnswer(grpc::Status::OK, Reply(false, 7));
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply = Push(&bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_EQ(reply->version(), 7u);
  EXPECT_EQ(bytes, PayloadBytes(spec_));
  EXPECT_TRUE(shards_[0].service.Pushes().empty());
  EXPECT_TRUE(shards_[1].service.Pushes().empty());
  const std::vector<std::vector<v1::PushChunk>> pushes = main_.service.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  // One stream, the header first, every layer in order (two chunks for layer 1).
  std::vector<uint32_t> ids;
  for (const v1::PushChunk& chunk : pushes[0]) ids.push_back(chunk.layer_id());
  EXPECT_THAT(ids, ElementsAre(0, 1, 1, 2));
  EXPECT_EQ(pushes[0][0].header().SerializeAsString(), Header().SerializeAsString());
  const Layers values = Values(spec_);
  const std::map<uint32_t, std::vector<float>> got = Decode(pushes[0], spec_);
  ASSERT_EQ(got.size(), 3u);
  for (uint32_t id = 0; id < 3; ++id) EXPECT_EQ(got.at(id), values[id]) << "layer " << id;

  std::vector<v1::ParamChunk> all;
  for (uint32_t id = 0; id < 3; ++id) all = Concat(std::move(all), LayerChunks(id, values[id], 4));
  main_.service.SetPullChunks(all);
  Layers layers;
  absl::StatusOr<uint64_t> version = client_.Pull(3, 4, false, spec_, &layers, &bytes);
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 4u);
  EXPECT_EQ(layers, values);
  EXPECT_EQ(shards_[0].service.Pulls() + shards_[1].service.Pulls(), 0);
}

TEST_F(ClientShardsTest, AShardWithoutAnAddressIsRefused) {
  EXPECT_THAT(client_.SetShards({shards_[0].address, ""}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard 1")));
  // The shards set before still serve.
  ServeOwnLayers(7, 7);
  Layers layers;
  uint64_t bytes = 0;
  EXPECT_THAT(client_.Pull(3, 7, false, spec_, &layers, &bytes), IsOk());
}

// Layer groups over the spec's three layers: group 0 = layers 0 (shard 0) and 1 (shard 1),
// group 1 = layer 2 (shard 0 only).
const std::vector<uint32_t> kGroups = {0, 0, 1};

// The Pull chunks of one layer of a by-group pull: model version `version`, the group's
// version `group_version`.
std::vector<v1::ParamChunk> GroupChunks(uint32_t id, const std::vector<float>& values,
                                        uint64_t version, uint64_t group_version) {
  std::vector<v1::ParamChunk> chunks = LayerChunks(id, values, version);
  for (v1::ParamChunk& chunk : chunks) chunk.set_group_version(group_version);
  return chunks;
}

v1::PushHeader GroupHeader(uint32_t group) {
  v1::PushHeader header = Header();
  header.set_group(group);
  header.set_task_continues(true);
  return header;
}

// The spec's values with only the layers of `group` filled (the others empty, as a streaming
// round pushes them).
Layers GroupValues(const v1::ModelSpec& spec, uint32_t group) {
  Layers layers = Values(spec);
  for (size_t l = 0; l < layers.size(); ++l) {
    if (kGroups[l] != group) layers[l].clear();
  }
  return layers;
}

// `stream` is one push under `header` of layer `id` alone, with its Values.
void ExpectLayerAlone(const std::vector<v1::PushChunk>& stream, const v1::ModelSpec& spec,
                      const v1::PushHeader& header, uint32_t id) {
  ASSERT_FALSE(stream.empty());
  EXPECT_EQ(stream[0].header().SerializeAsString(), header.SerializeAsString());
  const std::map<uint32_t, std::vector<float>> got = Decode(stream, spec);
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(got.count(id), 1u) << "layer " << id;
  EXPECT_EQ(got.at(id), Values(spec)[id]);
}

TEST(ShardsOfGroupTest, NamesEachShardOwningALayerOfTheGroupOnceInOrder) {
  v1::ModelSpec spec;
  const uint32_t owners[] = {1, 0, 1, 2, 1};
  for (uint32_t l = 0; l < 5; ++l) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(l);
    layer->set_num_elements(4);
    layer->set_shard(owners[l]);
  }
  const std::vector<uint32_t> groups = {0, 0, 1, 1, 1};
  EXPECT_THAT(ShardsOfGroup(spec, groups, 0), ElementsAre(0, 1));
  EXPECT_THAT(ShardsOfGroup(spec, groups, 1), ElementsAre(1, 2));
  EXPECT_TRUE(ShardsOfGroup(spec, groups, 2).empty());
  EXPECT_THAT(ShardsOfGroup(Spec(), kGroups, 1), ElementsAre(0));
}

// A scripted pull of a layer group from shards: shard s answers its calls with the versions
// queued for it, in order (the last one repeated); a status queued instead is its error.
// Records every call. Thread-safe (shards are pulled in parallel).
class ScriptedGroupPull {
 public:
  ScriptedGroupPull(std::map<uint32_t, std::vector<absl::StatusOr<std::optional<uint64_t>>>> sent)
      : sent_(std::move(sent)) {}
  GroupShardPull fn() {
    return [this](uint32_t shard, uint64_t version) -> absl::StatusOr<std::optional<uint64_t>> {
      absl::MutexLock lock(&mu_);
      calls_[shard].push_back(version);
      const auto& answers = sent_.at(shard);
      return answers[std::min(calls_[shard].size(), answers.size()) - 1];
    };
  }
  // The versions shard `shard` was asked for, in order.
  std::vector<uint64_t> calls(uint32_t shard) {
    absl::MutexLock lock(&mu_);
    return calls_[shard];
  }

 private:
  const std::map<uint32_t, std::vector<absl::StatusOr<std::optional<uint64_t>>>> sent_;
  absl::Mutex mu_;
  std::map<uint32_t, std::vector<uint64_t>> calls_ ABSL_GUARDED_BY(mu_);
};

TEST(PullAgreedGroupVersionTest, ShardsThatAgreeArePulledOnceAtTheLeastVersion) {
  ScriptedGroupPull pull({{0, {5}}, {2, {5}}});
  const std::vector<uint32_t> shards = {0, 2};
  absl::StatusOr<uint64_t> version = PullAgreedGroupVersion(shards, 1, 4, pull.fn());
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 5u);
  EXPECT_THAT(pull.calls(0), ElementsAre(4));
  EXPECT_THAT(pull.calls(2), ElementsAre(4));
}

TEST(PullAgreedGroupVersionTest, ShardsBehindArePulledAgainAtTheNewestUntilAllAgree) {
  // Shard 1 sent 6 before shards 0 and 2 applied that commit; shard 0 had applied 7 by the time
  // it was asked again, so shards 1 and 2 go once more, to 7. Shard 3's layers of the group are
  // empty: it sends no version and agrees with any.
  ScriptedGroupPull pull({{0, {5, 7}}, {1, {6, 7}}, {2, {5, 6, 7}}, {3, {std::nullopt}}});
  const std::vector<uint32_t> shards = {0, 1, 2, 3};
  absl::StatusOr<uint64_t> version = PullAgreedGroupVersion(shards, 0, 5, pull.fn());
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 7u);
  EXPECT_THAT(pull.calls(0), ElementsAre(5, 6));
  EXPECT_THAT(pull.calls(1), ElementsAre(5, 7));
  EXPECT_THAT(pull.calls(2), ElementsAre(5, 6, 7));
  EXPECT_THAT(pull.calls(3), ElementsAre(5));
}

TEST(PullAgreedGroupVersionTest, ShardsStillApartAfterTheLastRoundAreDataLossNamingEach) {
  ScriptedGroupPull pull({{0, {3}}, {1, {4}}});
  const std::vector<uint32_t> shards = {0, 1};
  EXPECT_THAT(PullAgreedGroupVersion(shards, 2, 3, pull.fn()),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("layer group 2"), HasSubstr("shard 0 at 3, shard 1 at 4"))));
  EXPECT_THAT(pull.calls(0), ElementsAre(3, 4, 4, 4));
  EXPECT_EQ(pull.calls(0).size(), static_cast<size_t>(kGroupPullRounds));
  EXPECT_THAT(pull.calls(1), ElementsAre(3));
}

TEST(PullAgreedGroupVersionTest, TheFirstFailedShardInOrderIsTheError) {
  ScriptedGroupPull pull({{0, {4}},
                          {1, {absl::UnavailableError("shard 1 down")}},
                          {2, {absl::DataLossError("shard 2 bad chunk")}}});
  const std::vector<uint32_t> shards = {0, 1, 2};
  EXPECT_THAT(PullAgreedGroupVersion(shards, 0, 4, pull.fn()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shard 1 down")));
  // A failure in a later round as well.
  ScriptedGroupPull later({{0, {3, absl::DeadlineExceededError("waited 10 s")}}, {1, {4}}});
  const std::vector<uint32_t> two = {0, 1};
  EXPECT_THAT(PullAgreedGroupVersion(two, 0, 3, later.fn()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("waited 10 s")));
  EXPECT_THAT(later.calls(0), ElementsAre(3, 4));
}

TEST_F(ClientShardsTest, PushGroupGoesOnlyToTheShardsOwningTheGroupEachWithItsLayers) {
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(false, 9));
  shards_[1].service.SetPushAnswer(grpc::Status::OK, Reply(false, 10));
  const Layers values = Values(spec_);
  uint64_t bytes = 0;
  // Group 1 is layer 2 alone, on shard 0: shard 1 gets nothing, not even the header.
  absl::StatusOr<v1::PushReply> reply = client_.PushGroup(
      GroupHeader(1), spec_, kGroups, GroupValues(spec_, 1), {}, 256, nullptr, &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_EQ(reply->version(), 9u);
  EXPECT_EQ(bytes, values[2].size() * sizeof(float));
  EXPECT_TRUE(shards_[1].service.Pushes().empty());
  std::vector<std::vector<v1::PushChunk>> pushes = shards_[0].service.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  ExpectLayerAlone(pushes[0], spec_, GroupHeader(1), 2);

  // Group 0: layer 0 to shard 0, layer 1 to shard 1, under the same header; shard 1's reply
  // completed the update.
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 9));
  v1::PushReply completed = Reply(false, 10);
  completed.set_group_version(4);
  shards_[1].service.SetPushAnswer(grpc::Status::OK, completed);
  bytes = 0;
  reply = client_.PushGroup(GroupHeader(0), spec_, kGroups, GroupValues(spec_, 0), {}, 256, nullptr,
                            &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_FALSE(reply->staged());
  EXPECT_EQ(reply->group_version(), 4u);
  EXPECT_EQ(bytes, (values[0].size() + values[1].size()) * sizeof(float));
  pushes = shards_[0].service.Pushes();
  ASSERT_EQ(pushes.size(), 2u);
  ExpectLayerAlone(pushes[1], spec_, GroupHeader(0), 0);
  pushes = shards_[1].service.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  ExpectLayerAlone(pushes[0], spec_, GroupHeader(0), 1);
  EXPECT_TRUE(main_.service.Pushes().empty());
}

TEST_F(ClientShardsTest, PushGroupCombinesOnlyTheAskedShardsReplies) {
  // Shard 1 would refuse, but takes no part in group 1.
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 6, 1));
  shards_[1].service.SetPushAnswer(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker"),
                                   v1::PushReply());
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply = client_.PushGroup(
      GroupHeader(1), spec_, kGroups, GroupValues(spec_, 1), {}, 256, nullptr, &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_TRUE(reply->staged());
  EXPECT_EQ(reply->slices_received(), 1u);
  EXPECT_EQ(reply->version(), 6u);
  // Group 0 involves it: its error is the push's.
  EXPECT_THAT(client_.PushGroup(GroupHeader(0), spec_, kGroups, GroupValues(spec_, 0), {}, 256,
                                nullptr, &bytes),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("shard 1"), HasSubstr("unknown worker"))));
  // A group without layers goes nowhere.
  EXPECT_THAT(
      client_.PushGroup(GroupHeader(2), spec_, kGroups, Layers(3), {}, 256, nullptr, &bytes),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer group 2")));
  EXPECT_EQ(shards_[0].service.Pushes().size(), 2u);
  EXPECT_EQ(shards_[1].service.Pushes().size(), 1u);
}

TEST_F(ClientShardsTest, PullGroupAsksOnlyTheGroupsShardsForTheirLayersAtTheLeastVersion) {
  const Layers values = Values(spec_);
  // Group 1 (layer 2): shard 0 only.
  shards_[0].service.SetPullChunks(GroupChunks(2, values[2], 11, 5));
  shards_[1].service.SetPullChunks(GroupChunks(1, values[1], 12, 3));
  Layers layers;
  uint64_t bytes = 0;
  absl::StatusOr<uint64_t> version = client_.PullGroup(3, 1, 5, spec_, kGroups, &layers, &bytes);
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 5u);
  ASSERT_EQ(layers.size(), 3u);
  EXPECT_TRUE(layers[0].empty());
  EXPECT_TRUE(layers[1].empty());
  EXPECT_EQ(layers[2], values[2]);
  EXPECT_EQ(bytes, values[2].size() * sizeof(float));
  EXPECT_EQ(shards_[1].service.Pulls(), 0);
  std::vector<v1::PullRequest> asked = shards_[0].service.PullRequests();
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].worker_id(), 3u);
  EXPECT_TRUE(asked[0].by_group());
  EXPECT_EQ(asked[0].group(), 1u);
  EXPECT_EQ(asked[0].version(), 5u);
  EXPECT_FALSE(asked[0].latest());

  // Group 0 (layers 0 and 1): both shards, each its own layer; the model versions may differ
  // (other groups' commits), the group's must not. Layer 2 keeps what it had.
  shards_[0].service.SetPullChunks(GroupChunks(0, values[0], 11, 3));
  bytes = 0;
  version = client_.PullGroup(3, 0, 2, spec_, kGroups, &layers, &bytes);
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 3u);
  EXPECT_EQ(layers, values);
  EXPECT_EQ(bytes, (values[0].size() + values[1].size()) * sizeof(float));
  asked = shards_[1].service.PullRequests();
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].group(), 0u);
  EXPECT_EQ(asked[0].version(), 2u);
  EXPECT_EQ(main_.service.Pulls(), 0);
}

TEST_F(ClientShardsTest, PullGroupPullsAShardBehindAgainAtTheNewerGroupVersion) {
  // Shard 1 applied group 0's commit 4; shard 0 still streams 3, and 4 once asked for it.
  const Layers values = Values(spec_);
  Layers newer = values;
  for (float& v : newer[0]) v += 1.0f;
  shards_[0].service.SetPullChunks(GroupChunks(0, values[0], 7, 3));
  shards_[0].service.SetPullChunksAt(4, GroupChunks(0, newer[0], 8, 4));
  shards_[1].service.SetPullChunks(GroupChunks(1, values[1], 8, 4));
  Layers layers;
  uint64_t bytes = 0;
  absl::StatusOr<uint64_t> version = client_.PullGroup(3, 0, 3, spec_, kGroups, &layers, &bytes);
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 4u);
  EXPECT_EQ(layers[0], newer[0]);
  EXPECT_EQ(layers[1], values[1]);
  const std::vector<v1::PullRequest> asked = shards_[0].service.PullRequests();
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_EQ(asked[0].version(), 3u);
  EXPECT_EQ(asked[1].version(), 4u);
  EXPECT_TRUE(asked[1].by_group());
  EXPECT_EQ(shards_[1].service.Pulls(), 1);
  // Every float received counts, the replaced stream too.
  EXPECT_EQ(bytes, (2 * values[0].size() + values[1].size()) * sizeof(float));

  // A shard that never catches up: kDataLoss naming both, after kGroupPullRounds pulls of it.
  shards_[0].service.SetPullChunksAt(4, GroupChunks(0, values[0], 7, 3));
  EXPECT_THAT(client_.PullGroup(3, 0, 3, spec_, kGroups, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("shard 0 at 3, shard 1 at 4")));
  EXPECT_EQ(shards_[0].service.Pulls(), 2 + kGroupPullRounds);
}

TEST_F(ClientShardsTest, PullGroupRefusesChunksOfOtherGroupsAndOtherShards) {
  const Layers values = Values(spec_);
  Layers layers;
  uint64_t bytes = 0;
  // Shard 0 streams layer 2 (group 1) in a pull of group 0.
  shards_[0].service.SetPullChunks(
      Concat(GroupChunks(0, values[0], 7, 3), GroupChunks(2, values[2], 7, 3)));
  shards_[1].service.SetPullChunks(GroupChunks(1, values[1], 7, 3));
  EXPECT_THAT(client_.PullGroup(3, 0, 3, spec_, kGroups, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("shard 0"), HasSubstr("bad chunk for layer 2"))));
  // Shard 0 streams shard 1's layer 1.
  shards_[0].service.SetPullChunks(
      Concat(GroupChunks(0, values[0], 7, 3), GroupChunks(1, values[1], 7, 3)));
  EXPECT_THAT(client_.PullGroup(3, 0, 3, spec_, kGroups, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("shard 0"), HasSubstr("layer 1 belongs to shard 1"))));
  // Shard 1 leaves its layer short.
  shards_[0].service.SetPullChunks(GroupChunks(0, values[0], 7, 3));
  std::vector<v1::ParamChunk> short_layer = GroupChunks(1, values[1], 7, 3);
  short_layer.pop_back();
  shards_[1].service.SetPullChunks(short_layer);
  EXPECT_THAT(client_.PullGroup(3, 0, 3, spec_, kGroups, &layers, &bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("layer 1 incomplete")));
}

// A shard's raw push listener (common/raw_push.h) on a loopback port: serves one connection at a
// time (a client pushes to a shard one push at a time), records every push and answers as set.
class FakeRawShard {
 public:
  struct Received {
    std::string token;
    v1::PushHeader header;
    std::vector<float> payload;
  };

  explicit FakeRawShard(const std::string& address = "127.0.0.1:0") {
    absl::StatusOr<int> fd = ListenTcp(address, &port_);
    EXPECT_THAT(fd, IsOk());
    fd_ = fd.value_or(-1);
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeRawShard() {
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void SetAnswer(const absl::Status& status, const v1::PushReply& reply) {
    absl::MutexLock lock(&mu_);
    status_ = status;
    reply_ = reply;
  }
  // Closes each connection after answering its first push, as a shard closes idle ones.
  void CloseAfterEachPush() { close_after_push_ = true; }
  std::vector<Received> Pushes() const {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }
  int connections() const { return connections_.load(); }

 private:
  void Run() {
    while (true) {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      ++connections_;
      Serve(c);
      close(c);
    }
  }
  void Serve(int c) {
    SocketStream in(c, absl::Seconds(10));
    while (true) {
      absl::StatusOr<RawPushRequest> request = ReadRawPushPrelude(in);
      if (!request.ok()) return;
      Received got{request->token, request->header,
                   std::vector<float>(request->payload_bytes / sizeof(float))};
      if (!in.ReadExactly(reinterpret_cast<char*>(got.payload.data()), request->payload_bytes)
               .ok()) {
        return;
      }
      std::string answer;
      {
        absl::MutexLock lock(&mu_);
        pushes_.push_back(std::move(got));
        answer = EncodeRawPushReply(status_, reply_);
      }
      if (!WriteAll(c, answer.data(), answer.size(), absl::Seconds(10)).ok()) return;
      if (close_after_push_) return;
    }
  }

  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> connections_{0};
  std::atomic<bool> close_after_push_{false};
  std::thread thread_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  v1::PushReply reply_ ABSL_GUARDED_BY(mu_);
  std::vector<Received> pushes_ ABSL_GUARDED_BY(mu_);
};

ClientOptions WithToken(const std::string& address, const std::string& token) {
  ClientOptions options = Plaintext(address);
  options.token = token;
  return options;
}

// Shard 0 takes raw pushes, shard 1 only gRPC ones.
class ClientRawPushTest : public ::testing::Test {
 protected:
  ClientRawPushTest() : client_(WithToken(main_.address, "tok")) {
    EXPECT_THAT(client_.SetShards({shards_[0].address, shards_[1].address}, {raw_.address(), ""}),
                IsOk());
    raw_.SetAnswer(absl::OkStatus(), Reply(true, 6));
    shards_[1].service.SetPushAnswer(grpc::Status::OK, Reply(false, 7));
  }

  FakeServer main_;
  FakeServer shards_[2];
  FakeRawShard raw_;
  ServerClient client_;
  const v1::ModelSpec spec_ = Spec();
};

TEST_F(ClientRawPushTest, FloatLayersGoRawWithTheTokenHeaderAndTheShardsLayersInOrder) {
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply =
      client_.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_TRUE(reply->applied());  // shard 1 (gRPC) completed the update
  EXPECT_EQ(bytes, PayloadBytes(spec_));
  EXPECT_TRUE(shards_[0].service.Pushes().empty()) << "shard 0 got a gRPC push";
  ASSERT_EQ(shards_[1].service.Pushes().size(), 1u);
  const std::vector<FakeRawShard::Received> pushes = raw_.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].token, "tok");
  EXPECT_EQ(pushes[0].header.SerializeAsString(), Header().SerializeAsString());
  const Layers values = Values(spec_);
  std::vector<float> expected = values[0];  // layers 0 and 2, in order
  expected.insert(expected.end(), values[2].begin(), values[2].end());
  EXPECT_EQ(pushes[0].payload, expected);
  // The connection stays open for the next push.
  ASSERT_THAT(client_.Push(Header(), spec_, values, {}, 256, nullptr, &bytes), IsOk());
  EXPECT_EQ(raw_.Pushes().size(), 2u);
  EXPECT_EQ(raw_.connections(), 1);
}

TEST_F(ClientRawPushTest, ASlicedPushSendsEachLayersSliceInOrder) {
  // An FSDP rank's push: slice 1 of 2 of every layer (SliceRange: the second half, rounded up).
  v1::PushHeader header = Header();
  header.set_slice(1);
  header.set_slices(2);
  const Layers values = Values(spec_);
  Layers slices;
  for (int l = 0; l < spec_.layers_size(); ++l) {
    const uint64_t n = spec_.layers(l).num_elements();
    const uint64_t first = (n + 1) / 2;
    slices.emplace_back(values[l].begin() + first, values[l].end());
  }
  uint64_t bytes = 0;
  ASSERT_THAT(client_.Push(header, spec_, slices, {}, 256, nullptr, &bytes), IsOk());
  const std::vector<FakeRawShard::Received> pushes = raw_.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].header.slices(), 2u);
  std::vector<float> expected = slices[0];  // layers 0 and 2 of shard 0: [5, 10) and [3, 5)
  expected.insert(expected.end(), slices[2].begin(), slices[2].end());
  EXPECT_EQ(pushes[0].payload, expected);
  // A slice buffer of the wrong size is refused before anything is sent.
  slices[2].pop_back();
  EXPECT_THAT(client_.Push(header, spec_, slices, {}, 256, nullptr, &bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2: 1 values to push")));
  EXPECT_EQ(raw_.Pushes().size(), 1u);
}

TEST_F(ClientRawPushTest, AShardWithAnEncodedLayerGetsItsPushOverGrpc) {
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 6));
  uint64_t bytes = 0;
  const std::vector<v1::Codec> codecs = {v1::CODEC_FP32, v1::CODEC_FP32, v1::CODEC_BF16};
  ASSERT_THAT(client_.Push(Header(), spec_, Values(spec_), codecs, 256, nullptr, &bytes), IsOk());
  EXPECT_TRUE(raw_.Pushes().empty());
  EXPECT_EQ(shards_[0].service.Pushes().size(), 1u);
}

TEST_F(ClientRawPushTest, TheShardsRefusalIsThePushErrorAndTheNextPushReconnects) {
  raw_.SetAnswer(absl::InvalidArgumentError("layer 2 (head): non-finite value nan"),
                 v1::PushReply());
  uint64_t bytes = 0;
  EXPECT_THAT(client_.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-finite value nan")));
  raw_.SetAnswer(absl::OkStatus(), Reply(true, 6));
  EXPECT_THAT(client_.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes), IsOk());
  EXPECT_EQ(raw_.connections(), 2);
}

TEST_F(ClientRawPushTest, AKeptConnectionTheShardClosedIsOpenedAgainOnce) {
  raw_.CloseAfterEachPush();
  uint64_t bytes = 0;
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(client_.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes), IsOk())
        << "push " << i;
  }
  EXPECT_EQ(raw_.Pushes().size(), 3u);
  EXPECT_EQ(raw_.connections(), 3);
}

TEST_F(ClientRawPushTest, AnUnreachableListenerSendsThePushOverGrpcForAWhile) {
  // Shard 0 names a raw push listener on a port nothing listens on (down, or misnamed).
  const std::string nowhere = "127.0.0.1:" + std::to_string(::aloe::testing::FreePort());
  ServerClient client(WithToken(main_.address, "tok"));
  ASSERT_THAT(client.SetShards({shards_[0].address, shards_[1].address}, {nowhere, ""}), IsOk());
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 6));
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> pushed =
      client.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes);
  ASSERT_THAT(pushed, IsOk());
  EXPECT_TRUE(pushed->applied());
  ASSERT_EQ(shards_[0].service.Pushes().size(), 1u);
  EXPECT_EQ(shards_[0].service.Pushes()[0][0].header().update_id(), Header().update_id());
  // The listener comes up: pushes keep going over gRPC for a while (one failed connect per
  // kRawPushRetry, not one per push).
  FakeRawShard late(nowhere);
  late.SetAnswer(absl::OkStatus(), Reply(true, 6));
  ASSERT_THAT(client.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes), IsOk());
  EXPECT_EQ(shards_[0].service.Pushes().size(), 2u);
  EXPECT_EQ(late.connections(), 0);
  EXPECT_TRUE(late.Pushes().empty());
}

// A single-process server that takes raw pushes (JoinReply.push_address, no shards) gets every
// layer over its listener; a push with an encoded layer, and any push while the listener cannot
// be reached, goes to the server over gRPC.
TEST_F(ClientRawPushTest, ASingleServersListenerGetsEveryLayerAndEncodedPushesUseGrpc) {
  FakeRawShard single;
  single.SetAnswer(absl::OkStatus(), Reply(false, 9));  // applied
  ServerClient client(WithToken(main_.address, "tok"));
  ASSERT_THAT(client.SetShards({}, {}, single.address()), IsOk());
  main_.service.SetPushAnswer(grpc::Status::OK, Reply(false, 9));
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply =
      client.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_TRUE(reply->applied());
  EXPECT_EQ(bytes, PayloadBytes(spec_));
  EXPECT_TRUE(main_.service.Pushes().empty()) << "the server got a gRPC push";
  const std::vector<FakeRawShard::Received> pushes = single.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].token, "tok");
  EXPECT_EQ(pushes[0].header.update_id(), Header().update_id());
  std::vector<float> all;  // every layer, in layer order
  for (const std::vector<float>& layer : Values(spec_))
    all.insert(all.end(), layer.begin(), layer.end());
  EXPECT_EQ(pushes[0].payload, all);
  // One bf16 layer: the whole push over gRPC.
  std::vector<v1::Codec> codecs(spec_.layers_size(), v1::CODEC_FP32);
  codecs[1] = v1::CODEC_BF16;
  ASSERT_THAT(client.Push(Header(), spec_, Values(spec_), codecs, 256, nullptr, &bytes), IsOk());
  EXPECT_EQ(main_.service.Pushes().size(), 1u);
  EXPECT_EQ(single.Pushes().size(), 1u);
  // Told no listener any more (a re-join): gRPC.
  ASSERT_THAT(client.SetShards({}, {}, ""), IsOk());
  ASSERT_THAT(client.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes), IsOk());
  EXPECT_EQ(main_.service.Pushes().size(), 2u);
  EXPECT_EQ(single.Pushes().size(), 1u);
  // A listener nobody answers at: the push goes over gRPC.
  const std::string nowhere = "127.0.0.1:" + std::to_string(::aloe::testing::FreePort());
  ASSERT_THAT(client.SetShards({}, {}, nowhere), IsOk());
  ASSERT_THAT(client.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes), IsOk());
  EXPECT_EQ(main_.service.Pushes().size(), 3u);
}

TEST_F(ClientRawPushTest, PushGroupSendsTheGroupsLayersRawToItsShardsOnly) {
  // Group 1 is layer 2 alone, on shard 0 (raw): only its bytes, and shard 1 hears nothing.
  uint64_t bytes = 0;
  absl::StatusOr<v1::PushReply> reply = client_.PushGroup(
      GroupHeader(1), spec_, kGroups, GroupValues(spec_, 1), {}, 256, nullptr, &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_TRUE(reply->staged());
  const Layers values = Values(spec_);
  EXPECT_EQ(bytes, values[2].size() * sizeof(float));
  std::vector<FakeRawShard::Received> pushes = raw_.Pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].header.group(), 1u);
  EXPECT_EQ(pushes[0].payload, values[2]);
  EXPECT_TRUE(shards_[1].service.Pushes().empty());
  EXPECT_TRUE(shards_[0].service.Pushes().empty());
  // Group 0: layer 0 raw to shard 0 (the bf16 layer 2 is not in the group), layer 1 over gRPC
  // to shard 1, which completes the update.
  const std::vector<v1::Codec> codecs = {v1::CODEC_FP32, v1::CODEC_FP32, v1::CODEC_BF16};
  reply = client_.PushGroup(GroupHeader(0), spec_, kGroups, GroupValues(spec_, 0), codecs, 256,
                            nullptr, &bytes);
  ASSERT_THAT(reply, IsOk());
  EXPECT_TRUE(reply->applied());
  pushes = raw_.Pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[1].header.group(), 0u);
  EXPECT_EQ(pushes[1].payload, values[0]);
  ASSERT_EQ(shards_[1].service.Pushes().size(), 1u);
  EXPECT_EQ(raw_.connections(), 1);
}

// A CA certificate whose key is gone: the client can load it, nobody can present a certificate
// it issued.
constexpr char kUnusedCaPem[] = R"(-----BEGIN CERTIFICATE-----
MIIBjjCCATWgAwIBAgIUbyRruw+l+kKCEzG2SKHHsbqXD+0wCgYIKoZIzj0EAwIw
HDEaMBgGA1UEAwwRYWxvZS11bml0LXRlc3QtY2EwIBcNMjYxMTI3MTcyNzAzWhgP
MjEyNjExMDMxNzI3MDNaMBwxGjAYBgNVBAMMEWFsb2UtdW5pdC10ZXN0LWNhMFkw
EwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEgwNAcHYQMJWV3J0U1j85Qh9GFQcXQ+Cs
/1rGIq0nBDHXkK2jWnAYEi407g1YlvjuwVBWsMaSKKj/lpqoqajVyKNTMFEwHQYD
VR0OBBYEFPenfa2g0S+3HXdXrjFTeyBHxppGMB8GA1UdIwQYMBaAFPenfa2g0S+3
HXdXrjFTeyBHxppGMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDRwAwRAIg
NiHY+MoIbJTR5WaEU5CEvAsOWfVkjFdP5rTGbGYlXQYCIF3p2FznK9bHtBoKiM8k
yyer1jip6EqoG5Ve0KWyB4i8
-----END CERTIFICATE-----
)";

// With a CA a raw push opens with a TLS handshake. A listener that does not speak TLS fails it,
// and the push fails: nothing goes out in plaintext, raw or over gRPC.
TEST_F(ClientRawPushTest, WithACaRawPushesSpeakTlsAndNeverFallBackToPlaintext) {
  ClientOptions options = WithToken(main_.address, "tok");
  options.tls_ca_pem = kUnusedCaPem;
  ServerClient client(options);
  ASSERT_THAT(client.SetShards({shards_[0].address, shards_[1].address}, {raw_.address(), ""}),
              IsOk());
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 6));
  uint64_t bytes = 0;
  EXPECT_THAT(client.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr(raw_.address()), HasSubstr("TLS handshake"))));
  EXPECT_EQ(raw_.connections(), 1);
  EXPECT_TRUE(raw_.Pushes().empty());
  EXPECT_TRUE(shards_[0].service.Pushes().empty());
}

TEST_F(ClientRawPushTest, RawPushesOffUseGrpcAndAddressListsMustMatch) {
  ClientOptions options = Plaintext(main_.address);
  options.raw_push = false;
  ServerClient grpc_only(options);
  ASSERT_THAT(grpc_only.SetShards({shards_[0].address, shards_[1].address}, {raw_.address(), ""}),
              IsOk());
  shards_[0].service.SetPushAnswer(grpc::Status::OK, Reply(true, 6));
  uint64_t bytes = 0;
  ASSERT_THAT(grpc_only.Push(Header(), spec_, Values(spec_), {}, 256, nullptr, &bytes), IsOk());
  EXPECT_TRUE(raw_.Pushes().empty());
  EXPECT_EQ(shards_[0].service.Pushes().size(), 1u);
  EXPECT_THAT(
      client_.SetShards({shards_[0].address, shards_[1].address}, {raw_.address()}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 raw push addresses for 2")));
}

}  // namespace
}  // namespace aloe::worker
