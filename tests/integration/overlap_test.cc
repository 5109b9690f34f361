// Overlapped communication (aloe-worker --overlap) against a server whose every pull takes
// 200 ms longer (--pull_delay_ms, a slow link): without overlap the worker waits for each pull
// and push between rounds; with it, round r is pushed and the next model pulled while round r+1
// trains, so the worker is almost never blocked on the network. Each round then starts from the
// model without its own previous update (one-step delay, accounted by the server as staleness).
// The same for a two-rank node (--nproc 2), every rank overlapping its own slices, and the same
// against a server with a grace window or sync rounds, where a look-ahead task starts from the
// version the round or window of the worker's last push closed at.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

// The server's aggregation policies.
constexpr char kPlainAsync[] =
    "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }\n";
constexpr char kGraceWindow[] =
    "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0.5 }\n";
constexpr char kSyncRounds[] = "aggregation { mode: AGGREGATION_SYNC min_workers: 1 }\n";

class OverlapTest : public LoopbackTest {
 protected:
  struct Job {
    double blocked = -1;          // the worker's fraction of wall time blocked on the network
    double network_seconds = -1;  // and those seconds (the rank blocked the most)
    int rounds = -1;
    double final_loss = 0;
    std::string log;
    std::string summary;  // the server's
  };

  // 8 versions of one trainer (100 steps at 2x slowdown: about a second per round) under
  // `aggregation`, with an evaluator measuring the final model. Outer SGD with lr 1: one worker
  // then trains exactly as it would alone, and eager overlap reproduces that (each round starts
  // from the previous round's end: the stale global model plus the fresh local update).
  // nproc 2: a two-rank node (FSDP over Gloo; no --slowdown there, so its rounds are shorter).
  Job Run(const std::string& overlap, int nproc = 1, const std::string& aggregation = kPlainAsync) {
    const int port = StartServer(
        absl::StrCat("local_steps: 100\nmax_versions: 8\neval_every: 1000000\n", aggregation),
        "outer_optimizer { type: OUTER_SGD lr: 1.0 }\n", {"--pull_delay_ms=200"});
    Job job;
    if (port == 0) return job;
    auto evaluator = StartJoinedEvaluator(port);
    auto trainer = StartWorker(port, "trainer", 0, nproc > 1 ? 1.0 : 2.0,
                               {"--overlap=" + overlap, absl::StrCat("--nproc=", nproc)});
    EXPECT_EQ(server_->Wait(absl::Seconds(240)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(trainer->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
    EXPECT_EQ(evaluator->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
    job.log = ReadFile(dir_ + "/trainer0.log");
    // The largest of the ranks' summaries (one per rank).
    auto value_after = [&](size_t at, const std::string& key) {
      const size_t from = job.log.find(key, at);
      double value = -1;
      if (from == std::string::npos) return value;
      const std::string rest = job.log.substr(from + key.size());
      absl::SimpleAtod(rest.substr(0, rest.find_first_of(" \n")), &value);
      return value;
    };
    for (size_t at = job.log.find("summary: rounds="); at != std::string::npos;
         at = job.log.find("summary: rounds=", at + 1)) {
      const double blocked = value_after(at, "blocked_on_network=");
      if (blocked > job.blocked) {
        job.blocked = blocked;
        job.network_seconds = value_after(at, "network_seconds=");
        job.rounds = static_cast<int>(value_after(at, "summary: rounds="));
      }
    }
    EXPECT_GE(job.blocked, 0) << job.log;
    EXPECT_GT(job.rounds, 0) << job.log;
    job.final_loss = FinalEvalLoss();
    job.summary = ReadFile(dir_ + "/summary");
    return job;
  }

  // Off, delayed and eager against one policy: the checks every policy passes.
  void ExpectOverlapHidesThePull(const std::string& aggregation) {
    const Job off = Run("off", 1, aggregation);
    const Job delayed = Run("delayed", 1, aggregation);
    const Job eager = Run("eager", 1, aggregation);
    std::printf(
        "%s: blocked on network: off %.1f%%, delayed %.1f%%, eager %.1f%%; final held-out "
        "loss: off %.4f, delayed %.4f, eager %.4f\n",
        std::string(absl::StripTrailingAsciiWhitespace(aggregation)).c_str(), 100 * off.blocked,
        100 * delayed.blocked, 100 * eager.blocked, off.final_loss, delayed.final_loss,
        eager.final_loss);
    // >= 200 ms of every round without overlap, however loaded the machine (as a share of wall
    // time ~18% of an unloaded ~1.2 s round, but 4.85% was seen beside a parallel test: a loaded
    // machine computes slower), and several times the overlapped share.
    EXPECT_GE(off.network_seconds, 0.75 * 0.2 * off.rounds) << off.log;
    EXPECT_GT(off.blocked, 3 * std::max(delayed.blocked, eager.blocked)) << off.log;
    EXPECT_LT(delayed.blocked, 0.05) << delayed.log;
    EXPECT_LT(eager.blocked, 0.05) << eager.log;
    // Without overlap every round starts from the version its predecessor produced; with it,
    // the second round starts from version 0 too (the first one's update is still being pushed).
    EXPECT_TRUE(absl::StrContains(off.log, "round 2: version 1 ")) << off.log;
    EXPECT_TRUE(absl::StrContains(delayed.log, "round 2: version 0 ")) << delayed.log;
    EXPECT_TRUE(absl::StrContains(delayed.log, "round 3: version 1 ")) << delayed.log;
    EXPECT_FALSE(absl::StrContains(delayed.log, "dropped")) << delayed.log;
    EXPECT_FALSE(absl::StrContains(eager.log, "without overlap")) << eager.log;
    // Eager with outer SGD at lr 1 and one worker starts every round where the previous one
    // ended, as without overlap: the same rounds, the same final model up to float rounding. The
    // naive delay restarts from a model without the previous update and re-learns it, so the
    // server applies it twice (paper 004: naive delay needs a lower outer lr; eager does not).
    EXPECT_LT(off.final_loss, 4.0) << off.log;  // byte-level start: ln 256 = 5.55
    EXPECT_NEAR(eager.final_loss, off.final_loss, 0.01 * off.final_loss) << off.log << eager.log;
    EXPECT_GT(delayed.final_loss, off.final_loss) << delayed.log;
    EXPECT_LT(delayed.final_loss, 5.5) << delayed.log;
    // No update past max_versions: look-ahead stops once the tasks out reach the last version.
    EXPECT_TRUE(absl::StrContains(eager.log, "-> version 8")) << eager.log;
    EXPECT_FALSE(absl::StrContains(eager.log, "-> version 9")) << eager.log;
    EXPECT_TRUE(absl::StrContains(eager.summary, "version=8\nupdates_applied=8\n"))
        << eager.summary;
  }
};

TEST_F(OverlapTest, OverlapHidesA200MillisecondPullBehindTraining) {
  ExpectOverlapHidesThePull(kPlainAsync);
}

// A grace window (the worker's push closes it at once, being the only trainer): the look-ahead
// task starts from the version at the close.
TEST_F(OverlapTest, OverlapHidesThePullBehindAGraceWindow) {
  ExpectOverlapHidesThePull(kGraceWindow);
}

// Sync rounds: the look-ahead task of round r+1 starts from round r's version, before round r
// closes, and its push joins round r+1.
TEST_F(OverlapTest, OverlapHidesThePullInSyncRounds) { ExpectOverlapHidesThePull(kSyncRounds); }

// A two-rank node: each rank pushes its slice of round r and pulls its slice of the next model
// in the background (the leader asks for the next task once every slice is in, and tells the
// other rank over a second process group) while round r+1 trains on the first. The same against
// sync rounds and a grace window, where the leader's look-ahead request waits for the round or
// window like a single process's.
TEST_F(OverlapTest, ATwoRankNodeOverlapsEveryRanksSlices) {
  const Job off = Run("off", 2);
  const Job eager = Run("eager", 2);
  const Job sync = Run("eager", 2, kSyncRounds);
  const Job grace = Run("eager", 2, kGraceWindow);
  std::printf(
      "two ranks, blocked on network: off %.1f%%, eager %.1f%% (sync rounds %.1f%%, grace window "
      "%.1f%%); final held-out loss: off %.4f, eager %.4f (%.4f, %.4f)\n",
      100 * off.blocked, 100 * eager.blocked, 100 * sync.blocked, 100 * grace.blocked,
      off.final_loss, eager.final_loss, sync.final_loss, grace.final_loss);
  EXPECT_GE(off.network_seconds, 0.75 * 0.2 * off.rounds) << off.log;
  EXPECT_LT(off.final_loss, 4.0) << off.log;
  for (const Job* job : {&eager, &sync, &grace}) {
    EXPECT_GT(off.blocked, 3 * job->blocked) << off.log << job->log;
    EXPECT_LT(job->blocked, 0.05) << job->log;
    EXPECT_TRUE(absl::StrContains(job->log, "(2 ranks)")) << job->log;
    EXPECT_TRUE(absl::StrContains(job->log, "round 2: version 0 ")) << job->log;
    EXPECT_TRUE(absl::StrContains(job->log, "round 3: version 1 ")) << job->log;
    EXPECT_FALSE(absl::StrContains(job->log, "dropped")) << job->log;
    // As for one process: eager with outer SGD at lr 1 and one worker trains the same rounds,
    // whatever the aggregation policy.
    EXPECT_NEAR(job->final_loss, off.final_loss, 0.01 * off.final_loss) << off.log << job->log;
    // Eight rounds, each one update of two slices, and none past the last version.
    EXPECT_TRUE(absl::StrContains(job->summary, "version=8\nupdates_applied=8\n")) << job->summary;
    EXPECT_TRUE(absl::StrContains(job->log, "rounds=8 ")) << job->log;
  }
}

// Two overlapping trainers of different speeds in sync rounds: the fast one's look-ahead request
// waits for the slow one's push to close the round. Every round aggregates exactly one update of
// each (none counted twice, none left out) and none is past the last version.
TEST_F(OverlapTest, TwoOverlappingTrainersOfDifferentSpeedsShareEverySyncRound) {
  const int port = StartServer(
      "local_steps: 30\nmax_versions: 6\naggregation { mode: AGGREGATION_SYNC min_workers: 2 }\n",
      "outer_optimizer { type: OUTER_SGD lr: 0.5 }\n");
  ASSERT_NE(port, 0);
  auto fast = StartWorker(port, "trainer", 0, 1.0, {"--overlap=eager"});
  auto slow = StartWorker(port, "trainer", 1, 3.0, {"--overlap=delayed"});
  EXPECT_EQ(server_->Wait(absl::Seconds(240)), std::optional<int>(0)) << Logs();
  EXPECT_EQ(fast->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  EXPECT_EQ(slow->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/summary"), "version=6\nupdates_applied=12\n"))
      << Logs();
  for (const char* name : {"/trainer0.log", "/trainer1.log"}) {
    const std::string log = ReadFile(dir_ + name);
    EXPECT_TRUE(absl::StrContains(log, "round 2: version 0 ")) << log;
    EXPECT_FALSE(absl::StrContains(log, "dropped")) << log;
  }
}

}  // namespace
}  // namespace aloe
