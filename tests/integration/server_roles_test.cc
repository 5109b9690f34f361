// The server's roles as classes, started and stopped in this process (server/app/): a
// single-process server and a coordinator with one shard process, each on loopback ports, with
// real gRPC calls between them.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/aloe.grpc.pb.h"
#include "server/app/coordinator.h"
#include "server/app/shard_process.h"
#include "server/app/single_process_server.h"
#include "tests/integration/loopback_cluster.h"

namespace aloe {
namespace {

using server::CoordinatorServer;
using server::ShardProcess;
using server::SingleProcessServer;
using testing::FreePort;
using testing::ReadFile;

class ServerRolesTest : public testing::LoopbackTest {
 protected:
  // The loopback corpus and a tiny model, with `extra` config text.
  v1::ServerConfig Config(const std::string& extra) {
    return InProcessConfig("roles.textproto", extra);
  }

  static std::unique_ptr<v1::Coordinator::Stub> Dial(int port) {
    return v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  // Joins as a trainer named `name`, retrying while the server answers UNAVAILABLE (shard
  // processes still assembling), up to 60 s.
  static grpc::Status Join(v1::Coordinator::Stub& stub, const std::string& name,
                           v1::JoinReply* reply) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_role(v1::ROLE_TRAINER);
    grpc::Status status;
    for (int attempt = 0; attempt < 300; ++attempt) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      status = stub.Join(&context, request, reply);
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return status;
  }

  // The kind of the task `worker` is handed (KIND_UNSPECIFIED when the request fails).
  static v1::Task::Kind TaskKind(v1::Coordinator::Stub& stub, uint64_t worker) {
    v1::TaskRequest request;
    request.set_worker_id(worker);
    v1::Task task;
    grpc::ClientContext context;
    grpc::Status status = stub.RequestTask(&context, request, &task);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return status.ok() ? task.kind() : v1::Task::KIND_UNSPECIFIED;
  }

  static grpc::Status Leave(v1::Coordinator::Stub& stub, uint64_t worker) {
    v1::LeaveRequest request;
    request.set_worker_id(worker);
    v1::LeaveReply reply;
    grpc::ClientContext context;
    return stub.Leave(&context, request, &reply);
  }
};

TEST_F(ServerRolesTest, ASingleProcessServerServesAJoinOnPortZeroAndShutsDown) {
  SingleProcessServer::Options options;
  options.core.config = Config("max_versions: 5");
  options.core.summary_file = dir_ + "/roles_summary";
  SingleProcessServer server(options);
  ASSERT_TRUE(server.Start().ok());
  ASSERT_GT(server.grpc_port(), 0);
  EXPECT_EQ(server.metrics_port(), 0);  // metrics_address "off"

  auto stub = Dial(server.grpc_port());
  v1::JoinReply joined;
  grpc::Status status = Join(*stub, "t0", &joined);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(joined.worker_id(), 0u);
  EXPECT_EQ(joined.version(), 0u);
  EXPECT_EQ(joined.shard_addresses_size(), 0);  // one process: no shard processes
  EXPECT_EQ(joined.model().d_model(), 32u);

  EXPECT_EQ(TaskKind(*stub, joined.worker_id()), v1::Task::TRAIN);
  EXPECT_FALSE(server.finished());

  // The trainer leaves with its task: nothing is open, so the drain ends at once.
  ASSERT_TRUE(Leave(*stub, joined.worker_id()).ok());
  ASSERT_TRUE(server.Shutdown("test").ok());
  EXPECT_EQ(ReadFile(dir_ + "/roles_summary"), "version=0\nupdates_applied=0\n");

  // Not listening any more.
  grpc::ClientContext after;
  after.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::JoinRequest again;
  again.set_name("late");
  EXPECT_FALSE(stub->Join(&after, again, &joined).ok());
}

TEST_F(ServerRolesTest, ADrainCutShortLeavesTheOpenTaskAndStops) {
  SingleProcessServer::Options options;
  options.core.config = Config("max_versions: 5");
  options.core.drain_time = absl::Hours(1);  // only `cut_short` can end the drain
  SingleProcessServer server(options);
  ASSERT_TRUE(server.Start().ok());
  auto stub = Dial(server.grpc_port());
  v1::JoinReply joined;
  ASSERT_TRUE(Join(*stub, "t0", &joined).ok());
  ASSERT_EQ(TaskKind(*stub, joined.worker_id()), v1::Task::TRAIN);
  int asked = 0;
  EXPECT_TRUE(server.Shutdown("test", [&] { return ++asked > 0; }).ok());
  EXPECT_EQ(asked, 1);
}

TEST_F(ServerRolesTest, ACoordinatorAndAShardProcessAssembleServeAJoinAndShutDown) {
  CoordinatorServer::Options coordinator_options;
  coordinator_options.core.config = Config("shard_processes: 1");
  CoordinatorServer coordinator(coordinator_options);
  ASSERT_TRUE(coordinator.Start().ok());
  ASSERT_GT(coordinator.grpc_port(), 0);

  ShardProcess::Options shard_options;
  shard_options.config = coordinator_options.core.config;
  shard_options.shard_index = 0;
  shard_options.listen = absl::StrCat("127.0.0.1:", FreePort());
  shard_options.coordinator = absl::StrCat("127.0.0.1:", coordinator.grpc_port());
  ShardProcess shard(shard_options);
  ASSERT_TRUE(shard.Start().ok());
  EXPECT_EQ(shard.grpc_port(), std::stoi(shard_options.listen.substr(10)));

  // Joins are answered once the shard process follows the coordinator.
  auto stub = Dial(coordinator.grpc_port());
  v1::JoinReply joined;
  grpc::Status status = Join(*stub, "t0", &joined);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(joined.shard_addresses_size(), 1);
  EXPECT_EQ(joined.shard_addresses(0), shard_options.listen);
  EXPECT_EQ(joined.version(), 0u);
  ASSERT_TRUE(Leave(*stub, joined.worker_id()).ok());

  // The shard process stops while the coordinator is idle (no order to wake its stream).
  EXPECT_FALSE(shard.finished());
  EXPECT_FALSE(coordinator.finished());
  EXPECT_TRUE(shard.Shutdown("test").ok());
  EXPECT_FALSE(shard.finished());  // stopped: the job is not over
  EXPECT_TRUE(coordinator.Shutdown("test").ok());
}

}  // namespace
}  // namespace aloe
