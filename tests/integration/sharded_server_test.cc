// A layer-sharded server on loopback: a coordinator and two shard processes (real aloe-server
// processes), an evaluator and two trainers (real aloe-worker processes). A shard process is
// killed in the middle of training and started again from its checkpoints; the processes
// reassemble at a common checkpoint and training completes, with every shard at the
// coordinator's final version.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/core/checkpoint_store.h"
#include "tests/integration/loopback_cluster.h"

namespace aloe::testing {
namespace {

// A port that was free a moment ago (the shard processes need fixed ports: workers are told
// their addresses).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// The version a shard process said it stopped at ("shard I stops at version N"), or -1.
int StoppedAt(const std::string& log) {
  const size_t at = log.rfind("stops at version ");
  int version = -1;
  if (at != std::string::npos) {
    absl::SimpleAtoi(log.substr(at + 17, log.find('\n', at) - at - 17), &version);
  }
  return version;
}

class ShardedServerTest : public LoopbackTest {
 protected:
  std::unique_ptr<Subprocess> StartShard(int index, int coordinator_port, bool resume) {
    std::vector<std::string> argv = {Bin("aloe-server"),
                                     "--config=" + dir_ + "/server.textproto",
                                     "--role=shard",
                                     absl::StrCat("--shard_index=", index),
                                     absl::StrCat("--listen=127.0.0.1:", shard_ports_[index]),
                                     absl::StrCat("--coordinator=127.0.0.1:", coordinator_port)};
    if (resume) argv.push_back("--resume");
    return std::make_unique<Subprocess>(
        argv, absl::StrCat(dir_, "/shard", index, resume ? "-resumed" : "", ".log"));
  }

  std::string ShardLogs() {
    std::string all = Logs();
    for (const char* f : {"shard0.log", "shard1.log", "shard1-resumed.log"}) {
      all += absl::StrCat("==== ", f, "\n", ReadFile(dir_ + "/" + f));
    }
    return all;
  }

  int shard_ports_[2] = {FreePort(), FreePort()};
};

TEST_F(ShardedServerTest, ShardRestartReassemblesAndTrainingCompletes) {
  const std::string ckpt = dir_ + "/ckpt";
  const int port = StartServer(
      absl::StrCat("shard_processes: 2\nmax_staged_updates: 4\nlocal_steps: 10\n"
                   "max_versions: 12\naggregation { mode: AGGREGATION_SYNC min_workers: 2 }\n"
                   "checkpoint { dir: \"",
                   ckpt, "\" every_versions: 2 keep: 3 }\n"),
      kNesterov, {"--role=coordinator"});
  ASSERT_GT(port, 0);
  auto shard0 = StartShard(0, port, false);
  auto shard1 = StartShard(1, port, false);
  auto evaluator = StartJoinedEvaluator(port);
  auto w0 = StartWorker(port, "trainer", 0);
  auto w1 = StartWorker(port, "trainer", 1, 1.5);

  // Both shards checkpointed version 4 (every 2 versions): kill shard 1 without warning.
  bool reached = false;
  for (int i = 0; i < 1200 && !reached; ++i) {
    reached = !server::CheckpointStore(ckpt + "/shard-1", 3).Versions().empty() &&
              server::CheckpointStore(ckpt + "/shard-1", 3).Versions().front() >= 4;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(reached) << ShardLogs();
  shard1->Signal(SIGKILL);
  ASSERT_TRUE(shard1->Wait(absl::Seconds(10)).has_value());
  auto resumed = StartShard(1, port, true);

  std::optional<int> code = server_->Wait(absl::Seconds(300));
  ASSERT_TRUE(code.has_value()) << "coordinator did not finish\n" << ShardLogs();
  ASSERT_EQ(*code, 0) << ShardLogs();
  EXPECT_EQ(w0->Wait(absl::Seconds(30)), std::optional<int>(0)) << ShardLogs();
  EXPECT_EQ(w1->Wait(absl::Seconds(30)), std::optional<int>(0)) << ShardLogs();
  EXPECT_EQ(evaluator->Wait(absl::Seconds(30)), std::optional<int>(0)) << ShardLogs();
  shard0->Signal(SIGTERM);
  resumed->Signal(SIGTERM);
  EXPECT_EQ(shard0->Wait(absl::Seconds(30)), std::optional<int>(0));
  EXPECT_EQ(resumed->Wait(absl::Seconds(30)), std::optional<int>(0));

  // Every process ends at the coordinator's final version.
  const std::string summary = ReadFile(dir_ + "/summary");
  ASSERT_TRUE(absl::StrContains(summary, "version=12")) << summary << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard0.log")), 12) << ShardLogs();
  EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard1-resumed.log")), 12) << ShardLogs();
  // The restart made everybody go back to a common checkpoint (>= 4) and assemble again.
  const std::string coordinator = ReadFile(dir_ + "/server.log");
  EXPECT_TRUE(absl::StrContains(coordinator, "shard 1 restarted")) << ShardLogs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/shard0.log"), "restored version")) << ShardLogs();
  // Training made progress across the restart: the last evaluation beats the first.
  std::vector<double> losses;
  for (absl::string_view line : absl::StrSplit(summary, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "eval=")) {
      double loss = 0;
      ASSERT_TRUE(absl::SimpleAtod(line.substr(line.find(':') + 1), &loss));
      losses.push_back(loss);
    }
  }
  ASSERT_GE(losses.size(), 2u) << summary;
  EXPECT_LT(losses.back(), losses.front() - 0.3) << summary;
}

}  // namespace
}  // namespace aloe::testing
