// Graceful shutdown on real processes: a worker sent SIGTERM mid-round stops at the next step
// end, pushes the steps it has done, leaves and exits 0; a server sent SIGTERM hands out no new
// work, waits for the round in flight to be pushed and applied, writes a final checkpoint of
// that version and exits 0.
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

class LifecycleTest : public LoopbackTest {
 protected:
  // Polls `path` until it contains `text`, up to `timeout`.
  bool WaitForLog(const std::string& path, const std::string& text, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (absl::StrContains(ReadFile(path), text)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
};

TEST_F(LifecycleTest, WorkerSigtermPushesThePartialRoundLeavesAndExitsZero) {
  // A round of 100000 steps never ends by itself within the test.
  const int port = StartServer("local_steps: 100000\naggregation { min_workers: 1 }\n");
  ASSERT_GT(port, 0);
  auto worker = StartWorker(port, "trainer", 0);
  const std::string log = dir_ + "/trainer0.log";
  ASSERT_TRUE(WaitForLog(log, "joined as worker", absl::Seconds(60))) << Logs();
  // Let it train a few steps of its round.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  worker->Signal(SIGTERM);
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(worker->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(30)) << "the round was not cut short";
  const std::string text = ReadFile(log);
  EXPECT_TRUE(absl::StrContains(text, "stopping: pushing the")) << text;
  EXPECT_TRUE(absl::StrContains(text, "-> version 1")) << text;  // the one-worker round applied
  EXPECT_EQ(Scraped("aloe_model_version"), 1) << Logs();
  EXPECT_EQ(Scraped("aloe_workers_left_total"), 1) << Logs();
  EXPECT_EQ(Scraped("aloe_live_workers"), 0) << Logs();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
}

TEST_F(LifecycleTest, ServerSigtermDrainsTheRoundInFlightThenCheckpointsAndExitsZero) {
  // 200 steps x 4 (slowdown) of the tiny model: the round takes about 4 s on an idle machine,
  // several times that on a loaded one; the drain waits for it as long as it takes.
  const int port =
      StartServer(absl::StrCat("local_steps: 200\naggregation { min_workers: 1 }\n",
                               "checkpoint { dir: \"", dir_, "/ckpt\" every_versions: 100 }\n"),
                  kNesterov, {"--drain_seconds=150"});
  ASSERT_GT(port, 0);
  auto worker = StartWorker(port, "trainer", 0, /*slowdown=*/4.0);
  ASSERT_TRUE(WaitForLog(dir_ + "/trainer0.log", "joined as worker", absl::Seconds(60))) << Logs();
  // The task is handed out right after the join; signal while its round trains.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_EQ(Scraped("aloe_model_version"), 0) << "the first round ended too soon\n" << Logs();
  server_->Signal(SIGTERM);
  ASSERT_EQ(server_->Wait(absl::Seconds(180)), std::optional<int>(0)) << Logs();
  const std::string server_log = ReadFile(dir_ + "/server.log");
  EXPECT_TRUE(absl::StrContains(server_log, "draining: no new work")) << server_log;
  EXPECT_TRUE(absl::StrContains(server_log, "drained: every open task finished")) << server_log;
  EXPECT_TRUE(absl::StrContains(server_log, "version 1: outer step over 1 updates")) << server_log;
  EXPECT_TRUE(absl::StrContains(server_log, "checkpoint of version 1 written")) << server_log;
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=1")) << Logs();
  // The worker outlives the server (it would rejoin a restarted one); stop it.
  worker->Signal(SIGTERM);
  EXPECT_EQ(worker->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
}

TEST_F(LifecycleTest, WorkerWithoutTheTrainingDataSaysSoLeavesAndExitsNonZero) {
  const int port = StartServer("local_steps: 5\naggregation { min_workers: 1 }\n");
  ASSERT_GT(port, 0);
  // A corpus directory with the manifest but none of the token files.
  const std::string empty = dir_ + "/no_tokens";
  ASSERT_EQ(
      std::system(("mkdir -p " + empty + " && cp " + dir_ + "/manifest.tsv " + empty).c_str()), 0);
  auto worker = StartWorker(port, "trainer", 0, 1.0, {"--corpus_dir=" + empty});
  const std::optional<int> code = worker->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << "the worker kept going without its data\n" << Logs();
  EXPECT_NE(*code, 0);
  const std::string log = ReadFile(dir_ + "/trainer0.log");
  EXPECT_TRUE(absl::StrContains(log, "training data: " + empty + "/shards/p")) << log;
  EXPECT_TRUE(absl::StrContains(log, "no such file")) << log;
  // Ends at once, not after a loop of asking for the same task again.
  EXPECT_FALSE(absl::StrContains(log, "dropped")) << log;
  // It left: the server does not wait for its lease to run out.
  EXPECT_EQ(Scraped("aloe_workers_left_total"), 1) << Logs();
  EXPECT_EQ(Scraped("aloe_live_workers"), 0) << Logs();
  EXPECT_EQ(Scraped("aloe_model_version"), 0) << Logs();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
}

}  // namespace
}  // namespace aloe
