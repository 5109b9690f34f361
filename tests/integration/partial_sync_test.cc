// Partial synchronization with real daemons: aloe-server with four layer groups, an evaluator
// and two aloe-worker trainers running streaming rounds, one of them behind an emulated long
// link (tools/link_emulator.h). The server must reach its last version (K model versions per
// full round of group pushes) and the held-out loss must fall, with asynchronous and with sync
// aggregation, on a single-process server and on a layer-sharded one (a coordinator and two
// shard processes, each group pushed to and pulled from the shard processes that own its
// layers), where both shard processes must stop at the coordinator's last version.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"
#include "tools/link_emulator.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::ReadFile;
using ::aloe::testing::ShardedLoopbackTest;
using ::aloe::testing::StoppedAt;
using ::aloe::testing::Subprocess;
using ::aloe::testing::SummaryValue;

// The asynchronous job: Delayed Nesterov with N = the trainers.
constexpr char kAsyncConfig[] = R"(
    local_steps: 12
    max_versions: 64
    eval_every: 1000000
    aggregation { mode: AGGREGATION_ASYNC min_workers: 1 }
    partial_sync { groups: 4 merge_delay_steps: 1 })";
constexpr char kDelayedNesterov[] =
    "outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 2 }";
// The sync job: four rounds of every group.
constexpr char kSyncConfig[] = R"(
    local_steps: 12
    max_versions: 16
    eval_every: 1000000
    aggregation { min_workers: 2 }
    partial_sync { groups: 4 })";
// A coordinator and two shard processes. A shard process stages every update until all its
// parts are in: a sync round of each group holds one update per trainer, so two trainers with
// four groups need 8 slots.
constexpr char kShards[] = "\nshard_processes: 2\nmax_staged_updates: 8\n";

class PartialSyncTest : public ShardedLoopbackTest {
 protected:
  // Runs the job of `config` with an evaluator and two trainers, trainer 1 behind a link of
  // 20 ms one-way delay at 50 Mbit/s, trainer 0 twice as slow per step (so that the far one
  // takes part in a short asynchronous job); every process must exit with 0. Fills run_ from
  // the server's summary file. `outer`: the outer optimizer's config. With `sharded` the server
  // is a coordinator and two shard processes (`config` has shard_processes 2); the shard
  // processes advertise addresses on the link (and raw push addresses with raw_pushes_), so
  // every worker's pulls and pushes cross it, and trainer 1's coordinator calls too.
  void TrainThroughALink(const std::string& config, const std::string& outer = kNesterov,
                         bool sharded = false) {
    const int port = StartServer(
        config, outer,
        sharded ? std::vector<std::string>{"--role=coordinator"} : std::vector<std::string>{});
    ASSERT_GT(port, 0);
    tools::LinkEmulatorOptions options;
    options.routes.push_back({"127.0.0.1:0", absl::StrCat("127.0.0.1:", port)});
    if (sharded) {
      // Routes 1 and 2: the shards' gRPC ports; 3 and 4: their raw push ports.
      for (int i = 0; i < 2; ++i) {
        options.routes.push_back({"127.0.0.1:0", absl::StrCat("127.0.0.1:", shard_ports_[i])});
      }
      for (int i = 0; raw_pushes_ && i < 2; ++i) {
        options.routes.push_back({"127.0.0.1:0", absl::StrCat("127.0.0.1:", push_ports_[i])});
      }
    }
    options.up.delay = absl::Milliseconds(20);
    options.up.rate_bps = 50e6;
    options.down = options.up;
    absl::StatusOr<std::unique_ptr<tools::LinkEmulator>> link = tools::LinkEmulator::Start(options);
    ASSERT_THAT(link.status(), IsOk());
    for (int i = 0; sharded && i < 2; ++i) {
      std::vector<std::string> advertise = {"--advertise=" + (*link)->address(1 + i)};
      if (raw_pushes_) advertise.push_back("--advertise_push=" + (*link)->address(3 + i));
      shards_[i] = StartShard(i, port, false, advertise);
    }
    auto evaluator = StartJoinedEvaluator(port);
    auto near = StartWorker(port, "trainer", 0, /*slowdown=*/2.0);
    auto far = StartWorker((*link)->port(0), "trainer", 1, 1.0, far_flags_);
    std::vector<Subprocess*> processes = {near.get(), far.get(), evaluator.get()};
    for (int i = 0; sharded && i < 2; ++i) processes.push_back(shards_[i].get());
    ASSERT_NO_FATAL_FAILURE(ExpectJobEnds(processes));
    // The far worker's group pushes and pulls crossed the link.
    const tools::LinkStats stats = (*link)->Stats();
    EXPECT_GT(stats.up_bytes, 0u);
    EXPECT_GT(stats.down_bytes, 0u);
    ReadSummary(&run_);
  }

  std::string Summary(const std::string& key) {
    return run_.summary.count(key) > 0 ? run_.summary.at(key) : "";
  }

  // The asynchronous job's outcome: its versions, the loss, both trainers' streaming rounds.
  // Returns the server's last version (0 when unknown).
  int ExpectAsyncJobTrained() {
    // Every group push is an outer step of its own. Pushes already under way when the job
    // reaches max_versions are still applied: at most one per group and trainer.
    int version = 0, applied = 0;
    EXPECT_TRUE(absl::SimpleAtoi(Summary("version"), &version)) << ShardLogs();
    EXPECT_TRUE(absl::SimpleAtoi(Summary("updates_applied"), &applied)) << ShardLogs();
    EXPECT_GE(version, 64) << ShardLogs();
    EXPECT_LE(version, 64 + 2 * 4) << ShardLogs();
    EXPECT_EQ(applied, version);
    EXPECT_GE(run_.evals.size(), 2u) << ShardLogs();
    if (run_.evals.size() >= 2) {
      EXPECT_EQ(run_.evals.front().first, 0);
      EXPECT_GE(run_.evals.back().first, 64);
      EXPECT_GT(run_.evals.front().second, 5.0);
      EXPECT_LT(run_.evals.back().second, run_.evals.front().second - 1.0)
          << "eval loss " << run_.evals.front().second << " -> " << run_.evals.back().second << "\n"
          << ShardLogs();
    }
    // Both trainers ran streaming rounds and said so.
    for (const char* log : {"/trainer0.log", "/trainer1.log"}) {
      const std::string text = ReadFile(dir_ + log);
      EXPECT_NE(text.find("4 layer groups"), std::string::npos) << text;
      EXPECT_GT(SummaryValue(text, "rounds"), 0) << text;
    }
    return version;
  }

  // The sync job's outcome: four rounds of every group, each an outer step on both trainers'
  // pushes, and the loss.
  void ExpectSyncJobTrained() {
    EXPECT_EQ(Summary("version"), "16") << ShardLogs();
    EXPECT_EQ(Summary("updates_applied"), "32") << ShardLogs();
    ASSERT_GE(run_.evals.size(), 2u) << ShardLogs();
    EXPECT_EQ(run_.evals.back().first, 16);
    EXPECT_LT(run_.evals.back().second, run_.evals.front().second - 0.5)
        << "eval loss " << run_.evals.front().second << " -> " << run_.evals.back().second << "\n"
        << ShardLogs();
  }

  // Both shard processes stopped at `version`, and trainer 1 trained against them.
  void ExpectShardsStoppedAt(int version) {
    EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard0.log")), version) << ShardLogs();
    EXPECT_EQ(StoppedAt(ReadFile(dir_ + "/shard1.log")), version) << ShardLogs();
    EXPECT_NE(ReadFile(dir_ + "/trainer1.log").find("(2 shard processes)"), std::string::npos)
        << ShardLogs();
  }

  TrainingRun run_;                     // the summary; scrape stays empty
  std::vector<std::string> far_flags_;  // aloe-worker flags of trainer 1, behind the link
};

TEST_F(PartialSyncTest, AsyncFourGroupsTrainThroughALinkAndEvalLossFalls) {
  // The far trainer overlaps: its next task trains while a task's last push crosses the link.
  far_flags_ = {"--overlap=delayed"};
  ASSERT_NO_FATAL_FAILURE(TrainThroughALink(kAsyncConfig, kDelayedNesterov));
  ExpectAsyncJobTrained();
  EXPECT_GT(SummaryValue(ReadFile(dir_ + "/trainer1.log"), "tasks_taken_ahead"), 0) << Logs();
  EXPECT_EQ(SummaryValue(ReadFile(dir_ + "/trainer0.log"), "tasks_taken_ahead"), 0) << Logs();
}

TEST_F(PartialSyncTest, SyncFourGroupsReachTheirVersionsThroughALink) {
  ASSERT_NO_FATAL_FAILURE(TrainThroughALink(kSyncConfig));
  ExpectSyncJobTrained();
}

TEST_F(PartialSyncTest, AsyncFourGroupsOnShardProcessesTrainThroughALinkAndEvalLossFalls) {
  raw_pushes_ = true;  // group pushes go raw where a shard process takes them
  ASSERT_NO_FATAL_FAILURE(TrainThroughALink(absl::StrCat(kAsyncConfig, kShards), kDelayedNesterov,
                                            /*sharded=*/true));
  ExpectShardsStoppedAt(ExpectAsyncJobTrained());
  for (int i = 0; i < 2; ++i) {
    const std::string log = ReadFile(absl::StrCat(dir_, "/shard", i, ".log"));
    EXPECT_NE(log.find("MB raw)"), std::string::npos) << log;
    EXPECT_EQ(log.find("(0.0 MB raw)"), std::string::npos) << "no raw group push\n" << log;
  }
}

TEST_F(PartialSyncTest, SyncFourGroupsOnShardProcessesReachTheirVersionsThroughALink) {
  ASSERT_NO_FATAL_FAILURE(
      TrainThroughALink(absl::StrCat(kSyncConfig, kShards), kNesterov, /*sharded=*/true));
  ExpectSyncJobTrained();
  ExpectShardsStoppedAt(16);
}

}  // namespace
}  // namespace aloe
