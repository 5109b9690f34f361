// The cap on versions held for pulls (ServerConfig.max_retained_versions) with real aloe-worker
// processes: a server whose every pull waits 400 ms before it reads the model (--pull_delay_ms, a
// slow link) and four trainers in plain async mode, so that several tasks are between hand-out
// and pull at every commit. With the default cap of 1 the server does not hold the versions
// beyond it: the workers whose base is gone give their task up and get a new one, and the job
// still reaches its last version with every process exiting 0. With a cap above the number of
// trainers nothing is ever given up.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;
using ::aloe::testing::Subprocess;

class RetentionTest : public LoopbackTest {
 protected:
  static constexpr int kTrainers = 4;
  static constexpr int kVersions = 12;

  struct Job {
    int given_up = 0;       // "gave up task" lines in the server's log
    int pulls_refused = 0;  // trainers' "task N dropped" lines naming a version not available
    int last_version = 0;   // the server's summary
  };

  Job Run(int cap) {
    Job job;
    const int port = StartServer(
        absl::StrCat("local_steps: 3\nmax_versions: ", kVersions,
                     "\neval_every: 1000000\nmax_retained_versions: ", cap,
                     "\naggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }\n"),
        kNesterov, {"--pull_delay_ms=400"});
    if (port == 0) return job;
    std::vector<std::unique_ptr<Subprocess>> trainers;
    for (int i = 0; i < kTrainers; ++i) trainers.push_back(StartWorker(port, "trainer", i));
    EXPECT_EQ(server_->Wait(absl::Seconds(240)), std::optional<int>(0)) << Logs();
    for (int i = 0; i < kTrainers; ++i) {
      EXPECT_EQ(trainers[i]->Wait(absl::Seconds(60)), std::optional<int>(0))
          << ReadFile(absl::StrCat(dir_, "/trainer", i, ".log"));
    }
    for (absl::string_view line : absl::StrSplit(ReadFile(dir_ + "/server.log"), '\n')) {
      job.given_up += absl::StrContains(line, "gave up task");
    }
    for (int i = 0; i < kTrainers; ++i) {
      for (absl::string_view line :
           absl::StrSplit(ReadFile(absl::StrCat(dir_, "/trainer", i, ".log")), '\n')) {
        job.pulls_refused +=
            absl::StrContains(line, " dropped: ") && absl::StrContains(line, "not available");
      }
    }
    // The last version, or a little more (pushes of tasks handed out before the stop).
    for (absl::string_view line : absl::StrSplit(ReadFile(dir_ + "/summary"), '\n')) {
      int version = 0;
      if (absl::ConsumePrefix(&line, "version=") && absl::SimpleAtoi(line, &version)) {
        job.last_version = version;
      }
    }
    return job;
  }
};

TEST_F(RetentionTest, WorkersWhoseBaseIsNotHeldGiveUpTheTaskAndTheJobCompletes) {
  const Job capped = Run(1);
  const Job roomy = Run(2 * kTrainers);
  std::printf("cap 1: %d tasks given up (%d pulls refused); cap %d: %d given up\n", capped.given_up,
              capped.pulls_refused, 2 * kTrainers, roomy.given_up);
  EXPECT_GE(capped.last_version, kVersions) << Logs();
  EXPECT_GE(roomy.last_version, kVersions) << Logs();
  // A refused pull is given up by name and replaced (the server logs each; one refused as the
  // job ends may not be).
  EXPECT_GT(capped.given_up, 0) << Logs();
  EXPECT_LE(capped.given_up, capped.pulls_refused) << Logs();
  EXPECT_EQ(roomy.given_up, 0) << Logs();
  EXPECT_EQ(roomy.pulls_refused, 0) << Logs();
}

}  // namespace
}  // namespace aloe
