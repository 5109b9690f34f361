// Partial synchronization with real daemons: aloe-server with four layer groups, an evaluator
// and two aloe-worker trainers running streaming rounds, one of them behind an emulated long
// link (tools/link_emulator.h). The server must reach its last version (K model versions per
// full round of group pushes) and the held-out loss must fall, with asynchronous and with sync
// aggregation.
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
using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;
using ::aloe::testing::SummaryValue;

class PartialSyncTest : public LoopbackTest {
 protected:
  // Runs the job of `config` with an evaluator and two trainers, trainer 1 behind a link of
  // 20 ms one-way delay at 50 Mbit/s, trainer 0 twice as slow per step (so that the far one
  // takes part in a short asynchronous job); every process must exit with 0. Fills run_ from
  // the server's summary file. `outer`: the outer optimizer's config.
  void TrainThroughALink(const std::string& config, const std::string& outer = kNesterov) {
    const int port = StartServer(config, outer);
    ASSERT_GT(port, 0);
    tools::LinkEmulatorOptions options;
    options.routes.push_back({"127.0.0.1:0", absl::StrCat("127.0.0.1:", port)});
    options.up.delay = absl::Milliseconds(20);
    options.up.rate_bps = 50e6;
    options.down = options.up;
    absl::StatusOr<std::unique_ptr<tools::LinkEmulator>> link = tools::LinkEmulator::Start(options);
    ASSERT_THAT(link.status(), IsOk());
    auto evaluator = StartJoinedEvaluator(port);
    auto near = StartWorker(port, "trainer", 0, /*slowdown=*/2.0);
    auto far = StartWorker((*link)->port(0), "trainer", 1);
    ASSERT_EQ(server_->Wait(absl::Seconds(120)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(near->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(far->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(evaluator->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
    // The far worker's group pushes and pulls crossed the link.
    const tools::LinkStats stats = (*link)->Stats();
    EXPECT_GT(stats.up_bytes, 0u);
    EXPECT_GT(stats.down_bytes, 0u);
    ReadSummary(&run_);
  }

  std::string Summary(const std::string& key) {
    return run_.summary.count(key) > 0 ? run_.summary.at(key) : "";
  }

  TrainingRun run_;  // the summary; scrape stays empty
};

TEST_F(PartialSyncTest, AsyncFourGroupsTrainThroughALinkAndEvalLossFalls) {
  ASSERT_NO_FATAL_FAILURE(TrainThroughALink(R"(
      local_steps: 12
      max_versions: 64
      eval_every: 1000000
      aggregation { mode: AGGREGATION_ASYNC min_workers: 1 }
      partial_sync { groups: 4 merge_delay_steps: 1 })",
                                            // Asynchronous: Delayed Nesterov, N = the trainers.
                                            "outer_optimizer { type: OUTER_DELAYED_NESTEROV "
                                            "lr: 0.7 momentum: 0.9 dn_buffer_size: 2 }"));
  // Every group push is an outer step of its own. Pushes already under way when the job
  // reaches max_versions are still applied: at most one per group and trainer.
  int version = 0, applied = 0;
  ASSERT_TRUE(absl::SimpleAtoi(Summary("version"), &version)) << Logs();
  ASSERT_TRUE(absl::SimpleAtoi(Summary("updates_applied"), &applied)) << Logs();
  EXPECT_GE(version, 64) << Logs();
  EXPECT_LE(version, 64 + 2 * 4) << Logs();
  EXPECT_EQ(applied, version);
  ASSERT_GE(run_.evals.size(), 2u) << Logs();
  EXPECT_EQ(run_.evals.front().first, 0);
  EXPECT_GE(run_.evals.back().first, 64);
  EXPECT_GT(run_.evals.front().second, 5.0);
  EXPECT_LT(run_.evals.back().second, run_.evals.front().second - 1.0)
      << "eval loss " << run_.evals.front().second << " -> " << run_.evals.back().second << "\n"
      << Logs();
  // Both trainers ran streaming rounds and said so.
  for (const char* log : {"/trainer0.log", "/trainer1.log"}) {
    const std::string text = ReadFile(dir_ + log);
    EXPECT_NE(text.find("4 layer groups"), std::string::npos) << text;
    EXPECT_GT(SummaryValue(text, "rounds"), 0) << text;
  }
}

TEST_F(PartialSyncTest, SyncFourGroupsReachTheirVersionsThroughALink) {
  ASSERT_NO_FATAL_FAILURE(TrainThroughALink(R"(
      local_steps: 12
      max_versions: 16
      eval_every: 1000000
      aggregation { min_workers: 2 }
      partial_sync { groups: 4 })"));
  // Four rounds of every group, each round an outer step on both trainers' pushes.
  EXPECT_EQ(Summary("version"), "16") << Logs();
  EXPECT_EQ(Summary("updates_applied"), "32") << Logs();
  ASSERT_GE(run_.evals.size(), 2u) << Logs();
  EXPECT_EQ(run_.evals.back().first, 16);
  EXPECT_LT(run_.evals.back().second, run_.evals.front().second - 0.5)
      << "eval loss " << run_.evals.front().second << " -> " << run_.evals.back().second << "\n"
      << Logs();
}

}  // namespace
}  // namespace aloe
