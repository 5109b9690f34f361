// aloe-export from a running server (tools/export.h), against the server roles started in this
// process (server/app/) on loopback ports:
//  - a single-process server after one outer step: the live export equals, bit for bit, the
//    initial model stepped once with the known pseudo-gradient (outer SGD, lr 1), and is the
//    same file as the export of the server's checkpoint of that version; versions not held or
//    not reached, and an unreachable server, are refused naming them, and write nothing;
//  - a coordinator with two shard processes: the export gathers every layer from the shard
//    process that owns it, equal to the stepped model bit for bit;
//  - a server that requires a token refuses an export without one;
//  - a server older than the observer role is named, with the way out (its checkpoint).
#include "tools/export.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/durable_file.h"
#include "common/safetensors.h"
#include "common/safetensors_model.h"
#include "common/status_matchers.h"
#include "server/app/coordinator.h"
#include "server/app/shard_process.h"
#include "server/app/single_process_server.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/loopback_server.h"
#include "worker/client.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using server::CoordinatorServer;
using server::ShardProcess;
using server::SingleProcessServer;
using ::testing::AllOf;
using testing::FreePort;
using ::testing::HasSubstr;

using Layers = std::vector<std::vector<float>>;

// Values of at most 0.01 in magnitude, a function of (layer, index) only.
Layers KnownPseudoGradient(const v1::ModelSpec& spec) {
  Layers g;
  for (const v1::LayerSpec& layer : spec.layers()) {
    std::vector<float>& values = g.emplace_back(layer.num_elements());
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = 0.01f * std::sin(static_cast<float>(layer.id() * 7919 + i));
    }
  }
  return g;
}

class ExportTest : public testing::LoopbackTest {
 protected:
  // The loopback corpus and a tiny model trained with outer SGD at lr 1 (one step moves the
  // model by exactly minus the pseudo-gradient), with `extra` config text; written to
  // config_path_.
  v1::ServerConfig Config(const std::string& extra) {
    config_path_ = dir_ + "/export.textproto";
    return InProcessConfig("export.textproto",
                           absl::StrCat("outer_optimizer { type: OUTER_SGD lr: 1 }\n", extra));
  }

  // One trainer's round: joins `client` (testing::JoinTrainer), takes a training task, pulls its
  // base version into *base and pushes KnownPseudoGradient for it. Returns the trainer's worker
  // id; 0 on failure (reported).
  static uint64_t TrainOneRound(worker::ServerClient& client, Layers* base, v1::ModelSpec* spec) {
    absl::StatusOr<v1::JoinReply> joined = testing::JoinTrainer(client, "trainer");
    EXPECT_THAT(joined, IsOk());
    if (!joined.ok()) return 0;
    *spec = joined->model_spec();
    absl::StatusOr<v1::Task> task;
    for (int i = 0; i < 30; ++i) {
      task = client.RequestTask(joined->worker_id());
      if (!task.ok() || task->kind() == v1::Task::TRAIN) break;
    }
    EXPECT_THAT(task, IsOk());
    if (!task.ok() || task->kind() != v1::Task::TRAIN) return 0;
    uint64_t bytes = 0;
    absl::StatusOr<uint64_t> pulled =
        client.Pull(joined->worker_id(), task->base_version(), false, *spec, base, &bytes);
    EXPECT_THAT(pulled, IsOk());
    EXPECT_EQ(pulled.value_or(99), 0u);
    absl::StatusOr<v1::PushReply> pushed =
        client.Push(testing::TrainHeader(joined->worker_id(), *task, 1), *spec,
                    KnownPseudoGradient(*spec), {}, 256, nullptr, &bytes);
    EXPECT_THAT(pushed, IsOk());
    EXPECT_FALSE(pushed.ok() && pushed->staged());
    return joined->worker_id();
  }

  // Expects the safetensors file `path` to hold `layers` of `spec` under GPT-2-style names, bit
  // for bit, at version `version`.
  static void ExpectFileHolds(const std::string& path, const v1::ModelSpec& spec,
                              const Layers& layers, uint64_t version) {
    absl::StatusOr<std::vector<SafetensorsTensor>> expected = ModelTensors(spec, layers, true);
    ASSERT_THAT(expected, IsOk());
    absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
    ASSERT_THAT(file, IsOk());
    EXPECT_EQ(file->metadata["aloe_version"], absl::StrCat(version));
    ASSERT_EQ(file->tensors.size(), expected->size());
    for (size_t t = 0; t < expected->size(); ++t) {
      const SafetensorsTensor& want = (*expected)[t];
      const SafetensorsTensor& got = file->tensors[t];
      EXPECT_EQ(got.name, want.name);
      EXPECT_EQ(got.shape, want.shape) << want.name;
      ASSERT_EQ(got.values.size(), want.values.size()) << want.name;
      EXPECT_EQ(
          std::memcmp(got.values.data(), want.values.data(), want.values.size() * sizeof(float)), 0)
          << want.name << " differs";
    }
  }

  // `base` stepped once by outer SGD at lr 1 with KnownPseudoGradient: base - g, as the server
  // computes it.
  static Layers SteppedOnce(const v1::ModelSpec& spec, const Layers& base) {
    const Layers g = KnownPseudoGradient(spec);
    Layers stepped = base;
    for (size_t l = 0; l < stepped.size(); ++l) {
      for (size_t i = 0; i < stepped[l].size(); ++i) stepped[l][i] = base[l][i] - 1.0f * g[l][i];
    }
    return stepped;
  }

  ExportOptions Live(int port, const std::string& out) {
    ExportOptions options;
    options.server = testing::ClientOptionsFor(port);
    options.out = dir_ + "/" + out;
    return options;
  }

  static bool Exists(const std::string& path) { return ReadWholeFile(path).ok(); }

  std::string config_path_;
};

TEST_F(ExportTest, ASingleProcessServersVersionEqualsTheSteppedModelAndItsCheckpointExport) {
  const std::string ckpt = dir_ + "/ckpt";
  SingleProcessServer::Options server_options;
  server_options.core.config =
      Config(absl::StrCat("checkpoint { dir: \"", ckpt, "\" every_versions: 1 }"));
  SingleProcessServer server(server_options);
  ASSERT_THAT(server.Start(), IsOk());
  const int port = server.grpc_port();

  worker::ServerClient trainer(testing::ClientOptionsFor(port));
  Layers base;
  v1::ModelSpec spec;
  const uint64_t trainer_id = TrainOneRound(trainer, &base, &spec);
  ASSERT_GT(trainer_id, 0u);
  const Layers stepped = SteppedOnce(spec, base);

  ExportOptions latest = Live(port, "live.safetensors");
  latest.config_json = dir_ + "/live.json";
  absl::StatusOr<ExportResult> exported = ExportModel(latest);
  ASSERT_THAT(exported, IsOk());
  EXPECT_EQ(exported->version, 1u);
  EXPECT_EQ(exported->source, absl::StrCat("aloe-server at 127.0.0.1:", port));
  EXPECT_EQ(exported->tensors, 17u);  // 2 embeddings, 12 of the block, 2 of ln_f, the head
  ExpectFileHolds(latest.out, spec, stepped, 1);

  // Version 1 by number: the same file.
  ExportOptions one = Live(port, "one.safetensors");
  one.version = 1;
  ASSERT_THAT(ExportModel(one), IsOk());
  EXPECT_EQ(ReadWholeFile(one.out).value_or("a"), ReadWholeFile(latest.out).value_or("b"));

  // The server's own checkpoint of version 1 exports to the same bytes.
  ExportOptions from_checkpoint;
  from_checkpoint.config = config_path_;
  from_checkpoint.checkpoint = ckpt;
  from_checkpoint.out = dir_ + "/ckpt.safetensors";
  from_checkpoint.config_json = dir_ + "/ckpt.json";
  absl::StatusOr<ExportResult> checkpointed;
  for (int i = 0; i < 100; ++i) {  // the ticker writes it within 100 ms of the step
    checkpointed = ExportModel(from_checkpoint);
    if (checkpointed.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_THAT(checkpointed, IsOk());
  EXPECT_EQ(checkpointed->version, 1u);
  EXPECT_EQ(ReadWholeFile(from_checkpoint.out).value_or("a"),
            ReadWholeFile(latest.out).value_or("b"));
  EXPECT_EQ(ReadWholeFile(from_checkpoint.config_json).value_or("a"),
            ReadWholeFile(latest.config_json).value_or("b"));

  // A version the server no longer holds, one it has not reached, an unreachable server: each
  // named, nothing written.
  ExportOptions gone = Live(port, "gone.safetensors");
  gone.version = 0;
  EXPECT_THAT(ExportModel(gone),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(absl::StrCat("aloe-server at 127.0.0.1:", port)),
                             HasSubstr("version 0 is not available (at version 1; retained:"))));
  EXPECT_FALSE(Exists(gone.out));
  ExportOptions ahead = Live(port, "ahead.safetensors");
  ahead.version = 7;
  EXPECT_THAT(ExportModel(ahead),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is at version 1: version 7 does not exist yet")));
  EXPECT_FALSE(Exists(ahead.out));
  const int nobody = FreePort();
  ExportOptions unreachable = Live(nobody, "unreachable.safetensors");
  EXPECT_THAT(ExportModel(unreachable),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr(absl::StrCat("cannot reach aloe-server at 127.0.0.1:", nobody))));
  EXPECT_FALSE(Exists(unreachable.out));

  // The exports left no member behind and took no task: the trainer trains on from version 1.
  absl::StatusOr<v1::Task> next = trainer.RequestTask(trainer_id);
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->kind(), v1::Task::TRAIN);
  EXPECT_EQ(next->base_version(), 1u);
  ASSERT_THAT(trainer.Leave(trainer_id), IsOk());
  EXPECT_THAT(server.Shutdown("test"), IsOk());
}

TEST_F(ExportTest, ALayerShardedServersVersionComesFromEveryShardProcess) {
  CoordinatorServer::Options coordinator_options;
  coordinator_options.core.config = Config("shard_processes: 2");
  CoordinatorServer coordinator(coordinator_options);
  ASSERT_THAT(coordinator.Start(), IsOk());
  const int port = coordinator.grpc_port();
  std::vector<std::unique_ptr<ShardProcess>> shards;
  for (uint32_t i = 0; i < 2; ++i) {
    ShardProcess::Options shard_options;
    shard_options.config = coordinator_options.core.config;
    shard_options.shard_index = i;
    shard_options.listen = absl::StrCat("127.0.0.1:", FreePort());
    shard_options.coordinator = absl::StrCat("127.0.0.1:", port);
    shards.push_back(std::make_unique<ShardProcess>(shard_options));
    ASSERT_THAT(shards.back()->Start(), IsOk());
  }

  worker::ServerClient trainer(testing::ClientOptionsFor(port));
  Layers base;
  v1::ModelSpec spec;
  const uint64_t trainer_id = TrainOneRound(trainer, &base, &spec);
  ASSERT_GT(trainer_id, 0u);
  std::set<uint32_t> owners;
  for (const v1::LayerSpec& layer : spec.layers()) owners.insert(layer.shard());
  EXPECT_EQ(owners.size(), 2u) << "both shard processes own layers";
  // Once both shard processes applied version 1 (a pull of it waits for that).
  Layers pulled;
  uint64_t bytes = 0;
  ASSERT_THAT(trainer.Pull(trainer_id, 1, false, spec, &pulled, &bytes), IsOk());

  ExportOptions latest = Live(port, "sharded.safetensors");
  absl::StatusOr<ExportResult> exported = ExportModel(latest);
  ASSERT_THAT(exported, IsOk());
  EXPECT_EQ(exported->version, 1u);
  ExpectFileHolds(latest.out, spec, SteppedOnce(spec, base), 1);

  ExportOptions gone = Live(port, "gone.safetensors");
  gone.version = 0;
  EXPECT_THAT(ExportModel(gone), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstr("version 0 is no longer held by shard")));
  EXPECT_FALSE(Exists(gone.out));

  ASSERT_THAT(trainer.Leave(trainer_id), IsOk());
  for (auto& shard : shards) EXPECT_THAT(shard->Shutdown("test"), IsOk());
  EXPECT_THAT(coordinator.Shutdown("test"), IsOk());
}

TEST_F(ExportTest, AServerThatRequiresATokenRefusesAnExportWithoutOne) {
  std::ofstream(dir_ + "/tokens") << "alice secret-token-of-alice\n";
  SingleProcessServer::Options server_options;
  server_options.core.config =
      Config(absl::StrCat("security { token_file: \"", dir_, "/tokens\" }"));
  SingleProcessServer server(server_options);
  ASSERT_THAT(server.Start(), IsOk());
  const int port = server.grpc_port();

  ExportOptions anonymous = Live(port, "anonymous.safetensors");
  EXPECT_THAT(ExportModel(anonymous),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr(absl::StrCat("aloe-server at 127.0.0.1:", port))));
  EXPECT_FALSE(Exists(anonymous.out));

  ExportOptions alice = Live(port, "alice.safetensors");
  alice.server.token = "secret-token-of-alice";
  absl::StatusOr<ExportResult> exported = ExportModel(alice);
  ASSERT_THAT(exported, IsOk());
  EXPECT_EQ(exported->version, 0u);
  EXPECT_TRUE(Exists(alice.out));
  EXPECT_THAT(server.Shutdown("test"), IsOk());
}

// A server from before the observer role: its Join refuses role 3 as a current server refuses
// a role it does not know.
class PreObserverCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* request, v1::JoinReply*) override {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("unknown role ", static_cast<int>(request->role())));
  }
};

TEST_F(ExportTest, AServerOlderThanTheObserverRoleIsNamedWithTheWayOut) {
  PreObserverCoordinator older;
  const ::aloe::testing::LoopbackServer server({&older});
  const int port = server.port();
  ASSERT_GT(port, 0);
  const ExportOptions options = Live(port, "older.safetensors");
  EXPECT_THAT(ExportModel(options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(absl::StrCat("aloe-server at 127.0.0.1:", port)),
                             HasSubstr("unknown role 3"),
                             HasSubstr("export its newest checkpoint instead"))));
  EXPECT_FALSE(Exists(options.out));
}

}  // namespace
}  // namespace aloe
