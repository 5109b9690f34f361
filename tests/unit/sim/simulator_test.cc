// The straggler simulator end to end on the real ServerCore with the synthetic objective and a
// tiny model: determinism, learning, sync fairness, membership events, virtual-time arithmetic
// of speed and trace profiles, A-EDiT budgets, async mode, and input parsing errors.
#include "sim/simulator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/config.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "sim/synthetic_trainer.h"

namespace aloe::sim {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

constexpr double kSpeeds[] = {1, 0.77, 0.38, 0.17};  // paper 002's 'very' heterogeneity

const std::vector<server::DataShard>& Shards() {
  static const auto* shards = new std::vector<server::DataShard>{
      {"a", "a.tok", 1000}, {"b", "b.tok", 2000}, {"c", "c.tok", 3000}, {"d", "d.tok", 4000}};
  return *shards;
}

// A tiny model (~1.4k parameters), sync DiLoCo with outer Nesterov (lr 0.7, beta 0.9), H = 5,
// all four workers in every round.
v1::ServerConfig SyncConfig() {
  v1::ServerConfig config;
  config.mutable_model()->set_vocab_size(16);
  config.mutable_model()->set_seq_len(8);
  config.mutable_model()->set_d_model(8);
  config.mutable_model()->set_num_layers(2);
  config.mutable_model()->set_num_heads(2);
  config.set_corpus_dir("unused");
  config.set_local_steps(5);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_SYNC);
  config.mutable_aggregation()->set_min_workers(4);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_NESTEROV);
  config.mutable_outer_optimizer()->set_lr(0.7f);
  config.mutable_outer_optimizer()->set_momentum(0.9f);
  config.set_max_versions(10);
  FillServerDefaults(&config);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

SimulatorOptions Options(std::vector<double> speeds = {std::begin(kSpeeds), std::end(kSpeeds)}) {
  SimulatorOptions options;
  for (double s : speeds) {
    auto profile = StepTimeProfile::Create({1.0 / s});
    EXPECT_THAT(profile, IsOk());
    options.workers.push_back(*profile);
  }
  return options;
}

// Runs the simulator with one SyntheticTrainer per worker plus an evaluation trainer.
absl::StatusOr<SimResult> RunSynthetic(const v1::ServerConfig& config, SimulatorOptions options) {
  const v1::ModelSpec spec = BuildTransformerSpec(config.model(), config.apply_groups());
  SyntheticObjectiveOptions o;
  o.seed = config.seed();
  auto objective = SyntheticObjective::Create(spec, Shards(), o);
  if (!objective.ok()) return objective.status();
  std::vector<std::unique_ptr<TrainerInterface>> trainers;
  for (size_t i = 0; i < options.workers.size(); ++i) {
    trainers.push_back(std::make_unique<SyntheticTrainer>(**objective));
  }
  auto simulator =
      Simulator::Create(config, Shards(), "heldout.tok", std::move(options), std::move(trainers),
                        std::make_unique<SyntheticTrainer>(**objective));
  if (!simulator.ok()) return simulator.status();
  return (*simulator)->Run();
}

std::vector<const SimRow*> RowsOf(const SimResult& result, int worker) {
  std::vector<const SimRow*> rows;
  for (const SimRow& row : result.rows) {
    if (row.worker == worker) rows.push_back(&row);
  }
  return rows;
}

std::vector<const SimRow*> EvalRows(const SimResult& result) {
  std::vector<const SimRow*> rows;
  for (const SimRow& row : result.rows) {
    if (row.eval_loss.has_value()) rows.push_back(&row);
  }
  return rows;
}

TEST(SimulatorTest, SameInputsGiveBitIdenticalCsv) {
  auto first = RunSynthetic(SyncConfig(), Options());
  auto second = RunSynthetic(SyncConfig(), Options());
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  const std::string csv = FormatCsv(*first);
  EXPECT_EQ(csv, FormatCsv(*second));
  EXPECT_EQ(FormatSummary(*first), FormatSummary(*second));
  // 40 pushes and the version-0 evaluation row.
  EXPECT_EQ(first->rows.size(), 41u);
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "virtual_time,version,worker,staleness,shard,steps,eval_loss,outcome");

  // A different seed changes the run (the CSV is not trivially constant).
  v1::ServerConfig other = SyncConfig();
  other.set_seed(7);
  auto third = RunSynthetic(other, Options());
  ASSERT_THAT(third, IsOk());
  EXPECT_NE(csv, FormatCsv(*third));
}

TEST(SimulatorTest, SyncEvalLossFallsAndEveryVersionIsEvaluated) {
  auto result = RunSynthetic(SyncConfig(), Options());
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  EXPECT_EQ(result->final_version, 10u);
  const std::vector<const SimRow*> evals = EvalRows(*result);
  ASSERT_EQ(evals.size(), 11u);  // versions 0..10
  EXPECT_EQ(evals.front()->version, 0u);
  EXPECT_EQ(evals.front()->outcome, SimRow::Outcome::kEval);
  const double initial = *evals.front()->eval_loss;
  EXPECT_GT(initial, 0.55);  // ~0.5 * (1 + spread^2) far from the targets
  EXPECT_LT(result->final_eval_loss, 0.6 * initial);
  EXPECT_DOUBLE_EQ(*evals.back()->eval_loss, result->final_eval_loss);
  for (size_t i = 1; i < evals.size(); ++i) {
    EXPECT_EQ(evals[i]->version, i);
    EXPECT_EQ(evals[i]->outcome, SimRow::Outcome::kApplied);  // the round's last push
  }
}

TEST(SimulatorTest, SyncGivesEqualUpdatesAndRoundsLastAsLongAsTheSlowestWorker) {
  auto result = RunSynthetic(SyncConfig(), Options());
  ASSERT_THAT(result, IsOk());
  EXPECT_THAT(result->updates_per_worker, ::testing::ElementsAre(10, 10, 10, 10));
  EXPECT_THAT(result->rejected_per_worker, ::testing::ElementsAre(0, 0, 0, 0));
  EXPECT_EQ(result->total_local_steps, 4u * 10u * 5u);
  // Each round waits for the 0.17 steps/s worker: 10 rounds x 5 steps / 0.17.
  EXPECT_NEAR(result->virtual_seconds, 10 * 5 / 0.17, 1e-6);
  // Worker 0 pushes 5 s into each round, worker 3 closes it.
  const auto fast = RowsOf(*result, 0);
  const auto slow = RowsOf(*result, 3);
  ASSERT_EQ(fast.size(), 10u);
  ASSERT_EQ(slow.size(), 10u);
  for (int r = 0; r < 10; ++r) {
    EXPECT_NEAR(fast[r]->virtual_seconds, r * 5 / 0.17 + 5, 1e-6);
    EXPECT_EQ(fast[r]->outcome, SimRow::Outcome::kAccepted);
    EXPECT_EQ(fast[r]->version, static_cast<uint64_t>(r));
    EXPECT_EQ(slow[r]->outcome, SimRow::Outcome::kApplied);
    EXPECT_EQ(slow[r]->version, static_cast<uint64_t>(r + 1));
    EXPECT_EQ(slow[r]->staleness, 0u);
    EXPECT_EQ(slow[r]->steps, 5u);
  }
}

TEST(SimulatorTest, MaxLocalStepsAndMaxVersionsStopTheRun) {
  v1::ServerConfig config = SyncConfig();
  config.set_max_versions(0);
  SimulatorOptions options = Options();
  options.max_local_steps = 60;  // three rounds of 4 x 5 steps
  auto by_steps = RunSynthetic(config, options);
  ASSERT_THAT(by_steps, IsOk());
  EXPECT_EQ(by_steps->stop_reason, "max_local_steps");
  EXPECT_EQ(by_steps->total_local_steps, 60u);
  EXPECT_EQ(by_steps->final_version, 3u);

  options = Options();
  options.max_versions = 4;
  auto by_versions = RunSynthetic(config, options);
  ASSERT_THAT(by_versions, IsOk());
  EXPECT_EQ(by_versions->stop_reason, "max_versions");
  EXPECT_EQ(by_versions->final_version, 4u);

  options = Options();
  options.max_virtual_seconds = 100;
  auto by_time = RunSynthetic(config, options);
  ASSERT_THAT(by_time, IsOk());
  EXPECT_EQ(by_time->stop_reason, "max_virtual_seconds");
  EXPECT_DOUBLE_EQ(by_time->virtual_seconds, 100);
  EXPECT_EQ(by_time->final_version, 3u);  // rounds end at 29.4, 58.8, 88.2 s
}

TEST(SimulatorTest, LateJoinerContributesFewerUpdates) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_min_workers(3);
  SimulatorOptions options = Options();
  ASSERT_THAT(ParseEvents("join@100:0"), IsOk());
  options.events = *ParseEvents("join@100:0");
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  const auto& updates = result->updates_per_worker;
  EXPECT_GT(updates[0], 0u);
  EXPECT_LT(updates[0], updates[1]);
  EXPECT_EQ(updates[1], 10u);
  EXPECT_EQ(updates[2], 10u);
  EXPECT_EQ(updates[3], 10u);
  for (const SimRow* row : RowsOf(*result, 0)) EXPECT_GT(row->virtual_seconds, 100);
}

TEST(SimulatorTest, LeaverInFlightWorkIsNotAppliedAndRoundsGoOnWithoutIt) {
  SimulatorOptions options = Options();
  // Worker 3's second task runs from 29.41 s to 58.82 s; it leaves at 40 s.
  options.events = *ParseEvents("leave@40:3");
  auto result = RunSynthetic(SyncConfig(), options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  EXPECT_EQ(result->final_version, 10u);
  const auto rows3 = RowsOf(*result, 3);
  ASSERT_EQ(rows3.size(), 1u);
  EXPECT_LT(rows3[0]->virtual_seconds, 40);
  EXPECT_EQ(result->updates_per_worker[3], 1u);
  EXPECT_EQ(result->updates_per_worker[0], 10u);
  EXPECT_EQ(result->total_local_steps, (1 + 3 * 10) * 5u);
  // The round in progress closes with worker 2's push (29.41 + 5 / 0.38 s), without worker 3.
  const auto rows2 = RowsOf(*result, 2);
  ASSERT_GE(rows2.size(), 2u);
  EXPECT_NEAR(rows2[1]->virtual_seconds, 5 / 0.17 + 5 / 0.38, 1e-6);
  EXPECT_EQ(rows2[1]->outcome, SimRow::Outcome::kApplied);
  EXPECT_EQ(rows2[1]->version, 2u);
}

TEST(SimulatorTest, CrashedWorkerIsDroppedWhenItsLeaseExpires) {
  v1::ServerConfig config = SyncConfig();
  config.set_lease_seconds(10);
  SimulatorOptions options = Options();
  options.events = *ParseEvents("crash@40:3");
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->final_version, 10u);
  EXPECT_EQ(result->updates_per_worker[3], 1u);
  // Round 2 waits for the silent worker until its lease runs out at 40 + 10 s; the expiry
  // completes it, so version 2 is recorded by an evaluation row at that time.
  bool found = false;
  for (const SimRow& row : result->rows) {
    if (row.version == 2 && row.outcome == SimRow::Outcome::kEval) {
      found = true;
      EXPECT_NEAR(row.virtual_seconds, 50, 1e-6);
      EXPECT_TRUE(row.eval_loss.has_value());
    }
  }
  EXPECT_TRUE(found) << FormatCsv(*result);
}

TEST(SimulatorTest, WorkerCanLeaveAndJoinAgain) {
  SimulatorOptions options = Options();
  options.events = *ParseEvents("leave@10:0,join@200:0");
  auto result = RunSynthetic(SyncConfig(), options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  const auto rows0 = RowsOf(*result, 0);
  ASSERT_GE(rows0.size(), 2u);
  EXPECT_LT(rows0[0]->virtual_seconds, 10);
  EXPECT_GT(rows0[1]->virtual_seconds, 200);
  EXPECT_LT(result->updates_per_worker[0], 10u);
}

TEST(SimulatorTest, TraceProfileCyclesAcrossTasks) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_min_workers(1);
  config.set_max_versions(3);
  SimulatorOptions options;
  auto profiles = ParseTrace("# one worker alternating fast and slow steps\n0,1\n0,3\n", "t");
  ASSERT_THAT(profiles, IsOk());
  options.workers = *profiles;
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  const auto rows = RowsOf(*result, 0);
  ASSERT_EQ(rows.size(), 3u);
  // Task 1: 1+3+1+3+1 = 9 s; task 2 resumes the cycle: 3+1+3+1+3 = 11 s; task 3: 9 s.
  EXPECT_NEAR(rows[0]->virtual_seconds, 9, 1e-9);
  EXPECT_NEAR(rows[1]->virtual_seconds, 20, 1e-9);
  EXPECT_NEAR(rows[2]->virtual_seconds, 29, 1e-9);
}

TEST(SimulatorTest, TimeBudgetRunsStepsUntilTheFirstStepEndAfterTheBudget) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_min_workers(2);
  config.mutable_local_work()->set_mode(v1::LOCAL_WORK_TIME_BUDGET);
  config.mutable_local_work()->set_time_budget_seconds(3);
  config.set_max_versions(2);
  auto result = RunSynthetic(config, Options({1, 0.5}));
  ASSERT_THAT(result, IsOk());
  // 1 s steps: 3 steps end exactly at the budget; 2 s steps: the second ends at 4 s >= 3 s.
  for (const SimRow* row : RowsOf(*result, 0)) EXPECT_EQ(row->steps, 3u);
  for (const SimRow* row : RowsOf(*result, 1)) EXPECT_EQ(row->steps, 2u);
  EXPECT_NEAR(result->virtual_seconds, 8, 1e-9);
}

TEST(SimulatorTest, AsyncFastWorkerContributesMoreAndLossStillFalls) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_grace_seconds(0.5);
  config.mutable_aggregation()->set_min_workers(1);
  // Async DiLoCo's smaller outer step (paper 002's toy: sync lr 0.7, async lr 0.07 with N=4).
  config.mutable_outer_optimizer()->set_lr(0.2f);
  config.set_max_versions(40);
  auto result = RunSynthetic(config, Options());
  ASSERT_THAT(result, IsOk());
  const auto& updates = result->updates_per_worker;
  EXPECT_GT(updates[0], updates[1]);
  EXPECT_GT(updates[1], updates[2]);
  EXPECT_GT(updates[2], updates[3]);
  EXPECT_GE(updates[0], 4 * updates[3]);
  const auto evals = EvalRows(*result);
  ASSERT_FALSE(evals.empty());
  EXPECT_LT(result->final_eval_loss, 0.6 * *evals.front()->eval_loss);
  // Updates of slow workers arrive stale.
  uint64_t max_staleness = 0;
  for (const SimRow* row : RowsOf(*result, 3))
    max_staleness = std::max(max_staleness, row->staleness);
  EXPECT_GT(max_staleness, 0u);
  // Still deterministic.
  auto again = RunSynthetic(config, Options());
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(FormatCsv(*result), FormatCsv(*again));
}

TEST(SimulatorTest, StallStopsARunThatCanNeverStart) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_min_workers(5);  // only four workers exist
  auto result = RunSynthetic(config, Options());
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "stalled");
  EXPECT_EQ(result->final_version, 0u);
}

TEST(SimulatorTest, CreateRejectsBadInputs) {
  const v1::ServerConfig config = SyncConfig();
  SimulatorOptions options = Options();
  options.events = *ParseEvents("leave@5:7");
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leave@5:7")));
  options.events = *ParseEvents("join@5:1,join@6:1");  // absent until 5 s, then present
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("join@6:1")));
  options.events = *ParseEvents("leave@5:1,crash@6:1");
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not present")));
  options.events = *ParseEvents("join@5:1,leave@1:1");  // sorted by time: leave, then join
  EXPECT_THAT(RunSynthetic(config, options), IsOk());
  options = Options();
  options.tick_seconds = 0;
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tick_seconds")));
  EXPECT_THAT(RunSynthetic(config, SimulatorOptions()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least one worker")));
}

TEST(SimulatorTest, RunTwiceIsAnError) {
  const v1::ServerConfig config = SyncConfig();
  const v1::ModelSpec spec = BuildTransformerSpec(config.model(), config.apply_groups());
  auto objective = SyntheticObjective::Create(spec, Shards(), {});
  ASSERT_THAT(objective, IsOk());
  std::vector<std::unique_ptr<TrainerInterface>> trainers;
  trainers.push_back(std::make_unique<SyntheticTrainer>(**objective));
  SimulatorOptions options = Options({1});
  v1::ServerConfig one = config;
  one.mutable_aggregation()->set_min_workers(1);
  one.set_max_versions(1);
  auto simulator = Simulator::Create(one, Shards(), "h", options, std::move(trainers),
                                     std::make_unique<SyntheticTrainer>(**objective));
  ASSERT_THAT(simulator, IsOk());
  EXPECT_THAT((*simulator)->Run(), IsOk());
  EXPECT_THAT((*simulator)->Run(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("once")));
}

// --- Network model and overlap. ---

// One worker, plain async (every push applied at once), outer SGD at lr 1, H = 5 steps of 1 s,
// three versions.
v1::ServerConfig OneWorkerConfig() {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_grace_seconds(0);
  config.mutable_aggregation()->set_min_workers(1);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_SGD);
  config.mutable_outer_optimizer()->set_lr(1);
  config.mutable_outer_optimizer()->set_momentum(0);
  config.set_max_versions(3);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

uint64_t ModelBytes(const v1::ServerConfig& config) {
  return PullBytes(BuildTransformerSpec(config.model(), config.apply_groups()));
}

// A link on which the whole model takes 4 s plus 0.1 s of latency, each way.
LinkSpec SlowLink(const v1::ServerConfig& config) {
  const double rate = static_cast<double>(ModelBytes(config)) / 4;
  return LinkSpec{rate, rate, 0.1};
}

TEST(SimulatorNetworkTest, PushArrivesAfterPullComputeAndUpload) {
  const v1::ServerConfig config = OneWorkerConfig();
  const uint64_t bytes = ModelBytes(config);
  EXPECT_EQ(
      PushBytes(BuildTransformerSpec(config.model(), config.apply_groups()), config.transport()),
      bytes);  // FP32 pushes
  SimulatorOptions options = Options({1});
  options.links = {SlowLink(config)};
  options.peak_window_seconds = 15;
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  // Each round: pull 0.1 + 4 s, 5 steps of 1 s, upload 0.1 + 4 s = 13.2 s.
  const auto rows = RowsOf(*result, 0);
  ASSERT_EQ(rows.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_NEAR(rows[r]->virtual_seconds, 13.2 * (r + 1), 1e-9);
    EXPECT_EQ(rows[r]->staleness, 0u);
  }
  EXPECT_NEAR(result->virtual_seconds, 39.6, 1e-9);
  ASSERT_EQ(result->workers.size(), 1u);
  const WorkerStats& w = result->workers[0];
  EXPECT_NEAR(w.compute_seconds, 15, 1e-9);
  EXPECT_NEAR(w.present_seconds, 39.6, 1e-9);
  EXPECT_NEAR(w.utilization, 15 / 39.6, 1e-9);
  EXPECT_EQ(w.bytes_up, 3 * bytes);
  EXPECT_EQ(w.bytes_down, 3 * bytes);
  // Uploads are received over [9.2, 13.2], [22.4, 26.4], [35.6, 39.6], pulls over [0.1, 4.1],
  // [13.3, 17.3], [26.5, 30.5]: a 15 s window holds one whole transfer and 1.8 s of the next.
  EXPECT_NEAR(w.peak_up_bytes_per_second, 1.45 * bytes / 15, 1e-6);
  EXPECT_NEAR(w.peak_down_bytes_per_second, 1.45 * bytes / 15, 1e-6);
  options.peak_window_seconds = 1;
  auto one_second = RunSynthetic(config, options);
  ASSERT_THAT(one_second, IsOk());
  EXPECT_NEAR(one_second->workers[0].peak_up_bytes_per_second, bytes / 4.0, 1e-6);
}

TEST(SimulatorNetworkTest, OverlapHidesTransfersBehindCompute) {
  const v1::ServerConfig config = OneWorkerConfig();
  SimulatorOptions options = Options({1});
  options.links = {SlowLink(config)};
  options.overlap = Overlap::kDelayed;
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  // Task 0: pulled at 4.1, computed until 9.1; its look-ahead task 1 (from version 0) is pulled
  // meanwhile (4.1 -> 8.2). Task 1 computes 9.1 -> 14.1 while task 0 uploads (-> 13.2, version
  // 1) and task 2 (from version 1) is pulled (13.2 -> 17.3). Task 2 computes 17.3 -> 22.3 while
  // task 1 uploads (-> 21.4, version 2); the look-ahead request then gets STOP (the tasks out
  // reach max_versions), so task 2 is pushed after its compute: 22.3 -> 26.4.
  const auto rows = RowsOf(*result, 0);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_NEAR(rows[0]->virtual_seconds, 13.2, 1e-9);
  EXPECT_NEAR(rows[1]->virtual_seconds, 21.4, 1e-9);
  EXPECT_NEAR(rows[2]->virtual_seconds, 26.4, 1e-9);
  EXPECT_EQ(rows[0]->staleness, 0u);
  EXPECT_EQ(rows[1]->staleness, 1u);  // one-step delay: task 1 started from version 0
  EXPECT_EQ(rows[2]->staleness, 1u);
  EXPECT_NEAR(result->virtual_seconds, 26.4, 1e-9);
  const WorkerStats& w = result->workers[0];
  EXPECT_NEAR(w.compute_seconds, 15, 1e-9);
  EXPECT_NEAR(w.utilization, 15 / 26.4, 1e-9);  // 0.568; 15 / 39.6 = 0.379 without overlap
  EXPECT_EQ(w.bytes_up, 3 * ModelBytes(config));
  EXPECT_EQ(w.bytes_down, 3 * ModelBytes(config));
}

TEST(SimulatorNetworkTest, EagerOverlapWithOneWorkerAndOuterSgdAtLrOneMatchesNoOverlap) {
  v1::ServerConfig config = OneWorkerConfig();
  config.set_max_versions(10);
  auto off = RunSynthetic(config, Options({1}));
  SimulatorOptions options = Options({1});
  options.overlap = Overlap::kEager;
  auto eager = RunSynthetic(config, options);
  options.overlap = Overlap::kDelayed;
  auto delayed = RunSynthetic(config, options);
  ASSERT_THAT(off, IsOk());
  ASSERT_THAT(eager, IsOk());
  ASSERT_THAT(delayed, IsOk());
  EXPECT_EQ(eager->final_version, 10u);
  // Without links the rounds follow each other at once either way.
  EXPECT_NEAR(eager->virtual_seconds, off->virtual_seconds, 1e-9);
  // Eager adds the round's own update to the next base: the model the server reaches one round
  // later (up to float rounding). Delayed re-learns it, and the server applies it twice. The
  // shard sampler draws a look-ahead task before the previous push is counted, so the shards
  // part ways after a few rounds; compare the rounds before that.
  const auto off_rows = RowsOf(*off, 0);
  const auto eager_rows = RowsOf(*eager, 0);
  const auto delayed_rows = RowsOf(*delayed, 0);
  ASSERT_EQ(off_rows.size(), 10u);
  ASSERT_EQ(eager_rows.size(), 10u);
  ASSERT_EQ(delayed_rows.size(), 10u);
  for (size_t r = 0; r < 4; ++r) {
    ASSERT_EQ(eager_rows[r]->shard, off_rows[r]->shard) << r;
    ASSERT_EQ(delayed_rows[r]->shard, off_rows[r]->shard) << r;
    EXPECT_EQ(eager_rows[r]->staleness, r == 0 ? 0u : 1u);
    EXPECT_NEAR(*eager_rows[r]->eval_loss, *off_rows[r]->eval_loss, 1e-6) << r;
  }
  EXPECT_DOUBLE_EQ(*delayed_rows[0]->eval_loss, *off_rows[0]->eval_loss);
  // 0.165 against 0.206: the update applied twice moves further.
  EXPECT_GT(std::abs(*delayed_rows[2]->eval_loss - *off_rows[2]->eval_loss),
            0.1 * *off_rows[2]->eval_loss);
}

// Two workers of 1 step/s in sync rounds (H = 5), two versions.
absl::StatusOr<SimResult> RunTwoWorkerSync(SimulatorOptions options) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_min_workers(2);
  config.set_max_versions(2);
  options.workers = Options({1, 1}).workers;
  return RunSynthetic(config, options);
}

// Virtual times and outcomes of a worker's push rows.
std::vector<std::pair<double, SimRow::Outcome>> Pushes(const SimResult& result, int worker) {
  std::vector<std::pair<double, SimRow::Outcome>> pushes;
  for (const SimRow* row : RowsOf(result, worker)) {
    // Rounded to the microsecond, as in the CSV.
    pushes.emplace_back(std::round(row->virtual_seconds * 1e6) / 1e6, row->outcome);
  }
  return pushes;
}

using Push = std::pair<double, SimRow::Outcome>;
constexpr SimRow::Outcome kApplied = SimRow::Outcome::kApplied;
constexpr SimRow::Outcome kAccepted = SimRow::Outcome::kAccepted;

TEST(SimulatorNetworkTest, SyncRoundWaitsForTheWorkerOnTheSlowLink) {
  const v1::ServerConfig config = SyncConfig();
  SimulatorOptions options;
  options.links = {LinkSpec{}, SlowLink(config)};
  auto result = RunTwoWorkerSync(options);
  ASSERT_THAT(result, IsOk());
  // Worker 0 (no link) pushes 5 s into each round; worker 1 pulls for 4.1 s, computes 5 s and
  // uploads for 4.1 s, closing the round at 13.2 s; then both start from version 1.
  EXPECT_THAT(Pushes(*result, 0),
              ::testing::ElementsAre(Push{5, kAccepted}, Push{18.2, kAccepted}));
  EXPECT_THAT(Pushes(*result, 1),
              ::testing::ElementsAre(Push{13.2, kApplied}, Push{26.4, kApplied}));
  EXPECT_EQ(result->final_version, 2u);
  EXPECT_NEAR(result->workers[0].utilization, 10 / 26.4, 1e-9);
  EXPECT_NEAR(result->workers[1].utilization, 10 / 26.4, 1e-9);
  EXPECT_EQ(result->workers[0].bytes_down, 2 * ModelBytes(config));
  // Instant transfers count whole in a window: two model pulls 13.2 s apart.
  EXPECT_NEAR(result->workers[0].peak_down_bytes_per_second,
              static_cast<double>(ModelBytes(config)), 1e-6);
}

TEST(SimulatorNetworkTest, TransfersQueueOnTheSharedServerLink) {
  const v1::ServerConfig config = SyncConfig();
  SimulatorOptions options;
  // The server link moves the model in 4 s each way; the workers' own links are unlimited.
  LinkSpec server = SlowLink(config);
  server.latency_seconds = 0;
  options.server_link = server;
  auto result = RunTwoWorkerSync(options);
  ASSERT_THAT(result, IsOk());
  // Round 1 opens when worker 1 joins (worker 0 waited for it), so worker 1 pulls first:
  // 0 -> 4, worker 0 queued 4 -> 8; computes 4 -> 9 and 8 -> 13; pushes 9 -> 13 and (queued)
  // 13 -> 17. Round 2 from 17 s: worker 0 asks first (its push closed the round): pulls
  // 17 -> 21 and 21 -> 25, computes 21 -> 26 and 25 -> 30, pushes 26 -> 30 and 30 -> 34.
  EXPECT_THAT(Pushes(*result, 0), ::testing::ElementsAre(Push{17, kApplied}, Push{30, kAccepted}));
  EXPECT_THAT(Pushes(*result, 1), ::testing::ElementsAre(Push{13, kAccepted}, Push{34, kApplied}));
  EXPECT_NEAR(result->workers[0].utilization, 10 / 34.0, 1e-9);
  // Each worker's own (unlimited) link received every model in an instant.
  EXPECT_NEAR(result->workers[1].peak_down_bytes_per_second,
              static_cast<double>(ModelBytes(config)), 1e-6);

  // Without the shared link, the same links per worker: no queueing, rounds of 13 s.
  options.server_link.reset();
  options.links = {server};
  auto own = RunTwoWorkerSync(options);
  ASSERT_THAT(own, IsOk());
  EXPECT_NEAR(own->virtual_seconds, 26, 1e-9);
}

TEST(SimulatorNetworkTest, HeldLookAheadRequestRunsOutAfterTenSeconds) {
  v1::ServerConfig config = SyncConfig();
  config.mutable_aggregation()->set_min_workers(2);
  config.set_max_versions(3);
  SimulatorOptions options = Options({1, 0.1});
  options.overlap = Overlap::kDelayed;
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  // Worker 0 trains round 1 (0 -> 5 s) and, ahead, round 2 (5 -> 10 s). Its round-1 push at
  // 5 s waits in the open round, so its next look-ahead request is answered WAIT and held: the
  // round closes only at 50 s (worker 1's push), so the hold runs out at 15 s and round 2 is
  // pushed then, without overlap (held for round 2 as well).
  const auto pushes = Pushes(*result, 0);
  ASSERT_GE(pushes.size(), 2u);
  EXPECT_EQ(pushes[0], (Push{5, kAccepted}));
  EXPECT_EQ(pushes[1], (Push{15, kAccepted}));
  EXPECT_EQ(RowsOf(*result, 0)[1]->version, 0u);
  EXPECT_EQ(result->stop_reason, "finished");

  // A round that closes within the hold: worker 1 at 0.5 steps/s closes round 1 at 10 s, the
  // held request gets its task then, and worker 0 computes without a gap until its work runs
  // out (the look-ahead request after its third round gets STOP: the tasks out reach version 3).
  options = Options({1, 0.5});
  options.overlap = Overlap::kDelayed;
  result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(Pushes(*result, 0)[1], (Push{10, kAccepted}));
  EXPECT_NEAR(result->workers[0].compute_seconds, 15, 1e-9);  // three rounds, 0 -> 15 s
  EXPECT_EQ(Pushes(*result, 0)[2], (Push{20, kAccepted}));
}

TEST(SimulatorNetworkTest, OverlapSurvivesMembershipChangesMidTransfer) {
  for (const bool sync : {true, false}) {
    v1::ServerConfig config = SyncConfig();
    config.mutable_aggregation()->set_min_workers(2);
    config.set_lease_seconds(10);
    config.set_max_versions(12);
    if (!sync) {
      config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
      config.mutable_aggregation()->set_grace_seconds(0.5);
      config.mutable_outer_optimizer()->set_lr(0.2f);
    }
    SimulatorOptions options = Options();
    options.overlap = Overlap::kEager;
    LinkSpec slow = SlowLink(config);
    options.links = {slow, LinkSpec{}, slow, slow};
    // Worker 0 leaves while pulling (its first pull runs 0 -> 4.1 s) and comes back; worker 2
    // crashes mid-round.
    options.events = *ParseEvents("leave@2:0,join@6:0,crash@25:2");
    auto result = RunSynthetic(config, options);
    ASSERT_THAT(result, IsOk());
    EXPECT_EQ(result->stop_reason, "finished") << "sync " << sync;
    // Async applies the pushes still in flight at the last version.
    EXPECT_GE(result->final_version, 12u);
    for (size_t i = 0; i < result->workers.size(); ++i) {
      const WorkerStats& w = result->workers[i];
      EXPECT_GT(w.compute_seconds, 0) << i;
      EXPECT_LE(w.compute_seconds, w.present_seconds + 1e-9) << i;
    }
    // Worker 0's lost pull still took its downlink: its second pull queued behind it.
    EXPECT_GE(result->workers[0].bytes_down, 2 * ModelBytes(config));
    EXPECT_NEAR(result->workers[2].present_seconds, 25, 1e-9);  // until its crash
    // Absent from 2 to 6 s (and gone at its STOP).
    EXPECT_LE(result->workers[0].present_seconds, result->virtual_seconds - 4 + 1e-9);
    auto again = RunSynthetic(config, options);
    ASSERT_THAT(again, IsOk());
    EXPECT_EQ(FormatCsv(*result), FormatCsv(*again));
    EXPECT_EQ(FormatWorkersCsv(*result), FormatWorkersCsv(*again));
  }
}

TEST(SimulatorNetworkTest, InfiniteLinkGivesTheSameRunAsNoLink) {
  for (const bool async : {false, true}) {
    v1::ServerConfig config = SyncConfig();
    SimulatorOptions options = Options();
    options.events = *ParseEvents("leave@12:1,join@40:1,crash@70:2");
    config.mutable_aggregation()->set_min_workers(2);
    if (async) {
      config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
      config.mutable_aggregation()->set_grace_seconds(0.5);
      config.mutable_outer_optimizer()->set_lr(0.2f);
      config.set_max_versions(30);
    }
    auto plain = RunSynthetic(config, options);
    options.links = {LinkSpec{}};
    options.server_link = LinkSpec{};
    auto infinite = RunSynthetic(config, options);
    ASSERT_THAT(plain, IsOk());
    ASSERT_THAT(infinite, IsOk());
    EXPECT_GT(plain->rows.size(), 10u);
    EXPECT_EQ(FormatCsv(*plain), FormatCsv(*infinite)) << "async " << async;
    EXPECT_EQ(FormatSummary(*plain), FormatSummary(*infinite));
    EXPECT_EQ(FormatWorkersCsv(*plain), FormatWorkersCsv(*infinite));
  }
}

TEST(SimulatorNetworkTest, TargetLossReportsTheFirstEvaluationAtOrBelowIt) {
  SimulatorOptions options = Options();
  auto reference = RunSynthetic(SyncConfig(), options);
  ASSERT_THAT(reference, IsOk());
  const auto evals = EvalRows(*reference);
  ASSERT_GE(evals.size(), 6u);
  // Between the losses of versions 2 and 3 (falling there): first reached at version 3.
  ASSERT_LT(*evals[3]->eval_loss, *evals[2]->eval_loss);
  const double target = 0.5 * (*evals[2]->eval_loss + *evals[3]->eval_loss);
  for (size_t i = 0; i < 3; ++i) ASSERT_GT(*evals[i]->eval_loss, target);
  options.target_loss = target;
  auto result = RunSynthetic(SyncConfig(), options);
  ASSERT_THAT(result, IsOk());
  ASSERT_TRUE(result->target_seconds.has_value());
  EXPECT_DOUBLE_EQ(*result->target_seconds, evals[3]->virtual_seconds);
  EXPECT_NEAR(*result->target_seconds, 3 * 5 / 0.17, 1e-6);
  EXPECT_THAT(FormatSummary(*result),
              HasSubstr(absl::StrFormat("target_seconds=%.3f", evals[3]->virtual_seconds)));
  options.target_loss = 0;  // never reached
  result = RunSynthetic(SyncConfig(), options);
  ASSERT_THAT(result, IsOk());
  EXPECT_FALSE(result->target_seconds.has_value());
  EXPECT_THAT(FormatSummary(*result), HasSubstr("target_loss=0 target_seconds=never"));
}

TEST(SimulatorNetworkTest, CreateRejectsBadLinksAndWindows) {
  const v1::ServerConfig config = SyncConfig();
  SimulatorOptions options = Options();
  options.links = *ParseLinks("10:5,10:5");
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 links for 4 workers")));
  options.links = {LinkSpec{}, LinkSpec{}, LinkSpec{0, 1, 0}, LinkSpec{}};
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("link 2")));
  options.links = {LinkSpec{1, 1, -1}};
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("link 0")));
  options.links.clear();
  options.server_link = LinkSpec{1, -1, 0};
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the server link")));
  options = Options();
  options.peak_window_seconds = 0;
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peak_window_seconds")));
  options = Options();
  options.target_loss = std::nan("");
  EXPECT_THAT(RunSynthetic(config, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target loss")));
  EXPECT_THAT(ParseOverlap("eager"), IsOk());
  EXPECT_THAT(ParseOverlap("on"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("off, delayed or eager")));
}

TEST(FormatWorkersCsvTest, WritesOneLinePerWorker) {
  SimResult result;
  result.updates_per_worker = {3};
  result.rejected_per_worker = {1};
  WorkerStats w;
  w.compute_seconds = 15;
  w.present_seconds = 20;
  w.utilization = 0.75;
  w.bytes_up = 100;
  w.bytes_down = 200;
  w.peak_up_bytes_per_second = 50;
  w.peak_down_bytes_per_second = 60.5;
  result.workers = {w};
  EXPECT_EQ(FormatWorkersCsv(result),
            "worker,updates,rejected,compute_seconds,present_seconds,utilization,bytes_up,"
            "bytes_down,peak_up_bytes_per_second,peak_down_bytes_per_second\n"
            "0,3,1,15.000000,20.000000,0.750000,100,200,50.000000,60.500000\n");
}

// --- Parsing. ---

TEST(ParseEventsTest, ParsesKindsTimesAndWorkers) {
  auto events = ParseEvents("join@1.5:2, leave@10:0,crash@3:1");
  ASSERT_THAT(events, IsOk());
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[0].kind, MembershipEvent::Kind::kJoin);
  EXPECT_DOUBLE_EQ((*events)[0].at_seconds, 1.5);
  EXPECT_EQ((*events)[0].worker, 2);
  EXPECT_EQ((*events)[1].kind, MembershipEvent::Kind::kLeave);
  EXPECT_EQ((*events)[2].kind, MembershipEvent::Kind::kCrash);
  EXPECT_THAT(ParseEvents(""), IsOk());
  EXPECT_THAT(ParseEvents("jump@1:0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown kind 'jump'")));
  EXPECT_THAT(ParseEvents("join@x:0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("join@x:0")));
  EXPECT_THAT(ParseEvents("join@-1:0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">= 0")));
  EXPECT_THAT(ParseEvents("join@1:-1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker index")));
  EXPECT_THAT(ParseEvents("join1:0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected join@T:i")));
}

TEST(FormatCsvTest, WritesEveryColumnAndQuotesWhenNeeded) {
  SimResult result;
  SimRow eval;
  eval.virtual_seconds = 0;
  eval.version = 0;
  eval.eval_loss = 2.5;
  eval.outcome = SimRow::Outcome::kEval;
  result.rows.push_back(eval);
  SimRow push;
  push.virtual_seconds = 1.25;
  push.version = 1;
  push.worker = 3;
  push.staleness = 2;
  push.shard = "a,b";
  push.steps = 20;
  push.outcome = SimRow::Outcome::kRejected;
  result.rows.push_back(push);
  EXPECT_EQ(FormatCsv(result),
            "virtual_time,version,worker,staleness,shard,steps,eval_loss,outcome\n"
            "0.000000,0,,,,,2.500000,eval\n"
            "1.250000,1,3,2,\"a,b\",20,,rejected\n");
}

// --- Partial synchronization (layer groups): the streaming round.

v1::ServerConfig GroupConfig(uint32_t groups) {
  v1::ServerConfig config = OneWorkerConfig();
  config.set_local_steps(4);
  config.mutable_partial_sync()->set_groups(groups);
  config.set_max_versions(4);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

TEST(SimulatorStreamingTest, GroupsArePushedAtTheirStridedStepsAndVersionPerPush) {
  // H = 4 steps of 1 s, K = 2 strided: group 0 after step 2, group 1 after step 4 (the task's
  // last push). Instant transfers; every push is its own outer step (async, grace 0).
  auto result = RunSynthetic(GroupConfig(2), Options({1}));
  ASSERT_THAT(result, IsOk());
  const auto rows = RowsOf(*result, 0);
  ASSERT_EQ(rows.size(), 4u);
  const double times[] = {2, 4, 6, 8};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(rows[i]->virtual_seconds, times[i], 1e-9) << i;
    EXPECT_EQ(rows[i]->version, static_cast<uint64_t>(i + 1));
    EXPECT_EQ(rows[i]->outcome, SimRow::Outcome::kApplied);
    EXPECT_EQ(rows[i]->steps, i % 2 == 1 ? 4u : 0u);  // the task's steps count with its last push
  }
  EXPECT_EQ(result->total_local_steps, 8u);
  EXPECT_EQ(result->rejected_per_worker[0], 0u);
  EXPECT_LT(result->final_eval_loss, result->rows.front().eval_loss.value_or(1e9));
}

TEST(SimulatorStreamingTest, ASyncGroupRoundHoldsTheFastWorkerAtItsMerge) {
  v1::ServerConfig config = GroupConfig(2);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_SYNC);
  config.mutable_aggregation()->set_min_workers(2);
  config.set_max_versions(4);
  // Worker 0 steps in 1 s, worker 1 in 2 s: group 0's round closes when worker 1 pushes it
  // after its 2nd step (t = 4); worker 0 pushed group 0 at t = 2 and goes on training; it takes
  // group 0 again before pushing it in its next task (after its step 6, t = 6), so it is not held.
  // Group 1 (after step 4): worker 0 at t = 4, worker 1 at t = 8; both rounds then close.
  auto result = RunSynthetic(config, Options({1, 0.5}));
  ASSERT_THAT(result, IsOk());
  const auto fast = RowsOf(*result, 0);
  const auto slow = RowsOf(*result, 1);
  ASSERT_GE(fast.size(), 2u);
  ASSERT_GE(slow.size(), 2u);
  EXPECT_NEAR(fast[0]->virtual_seconds, 2, 1e-9);
  EXPECT_EQ(fast[0]->outcome, SimRow::Outcome::kAccepted);
  EXPECT_NEAR(slow[0]->virtual_seconds, 4, 1e-9);
  EXPECT_EQ(slow[0]->outcome, SimRow::Outcome::kApplied);
  EXPECT_NEAR(slow[1]->virtual_seconds, 8, 1e-9);
  EXPECT_EQ(slow[1]->version, 2u);
  // The fast worker's next group 0 push waits for group 0's round: it took the group (and
  // its merge) only once the round closed at t = 4, so it cannot be earlier than that.
  ASSERT_GE(fast.size(), 3u);
  EXPECT_GE(fast[2]->virtual_seconds, 6 - 1e-9);
  EXPECT_EQ(result->rejected_per_worker[0] + result->rejected_per_worker[1], 0u);
}

TEST(SimulatorStreamingTest, DelayedMergesHideGroupPushesBehindComputeOnASlowLink) {
  // The same 32 local steps on a link where the whole model takes 4 s each way (steps of 1 s).
  // Whole-model rounds stop for a pull and a push; four groups merged 2 steps after their push
  // (Streaming DiLoCo's tau) move one group at a time while the worker trains.
  auto run = [](uint32_t groups) {
    v1::ServerConfig config = GroupConfig(groups);
    config.set_max_versions(0);
    config.set_local_steps(8);
    config.mutable_partial_sync()->set_merge_delay_steps(2);
    SimulatorOptions options = Options({1});
    options.links = {SlowLink(config)};
    options.max_local_steps = 32;
    auto result = RunSynthetic(config, options);
    EXPECT_THAT(result, IsOk());
    return *result;
  };
  const SimResult whole = run(1);
  const SimResult four = run(4);
  EXPECT_EQ(whole.total_local_steps, 32u);
  EXPECT_EQ(four.total_local_steps, 32u);
  EXPECT_EQ(four.rejected_per_worker[0], 0u);
  EXPECT_LT(four.virtual_seconds, whole.virtual_seconds);
  EXPECT_GT(four.workers[0].utilization, whole.workers[0].utilization);
}

// --- Lossy pushes (sim/push_codec.h) -------------------------------------------------------

v1::ServerConfig WithCodec(v1::ServerConfig config, v1::Codec codec, bool error_feedback) {
  config.mutable_transport()->set_codec(codec);
  config.mutable_transport()->set_error_feedback(error_feedback);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

TEST(SimulatorCodecTest, LossyPushesChangeTheRunDeterministically) {
  const v1::ServerConfig fp32 = SyncConfig();
  const v1::ServerConfig int4 = WithCodec(fp32, v1::CODEC_INT4_BLOCKWISE, false);
  const v1::ServerConfig int4_ef = WithCodec(fp32, v1::CODEC_INT4_BLOCKWISE, true);
  auto exact = RunSynthetic(fp32, Options());
  auto lossy = RunSynthetic(int4, Options());
  auto again = RunSynthetic(int4, Options());
  auto feedback = RunSynthetic(int4_ef, Options());
  ASSERT_THAT(exact, IsOk());
  ASSERT_THAT(lossy, IsOk());
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT(feedback, IsOk());
  // Same schedule (40 pushes, 10 versions), other updates: int4 without error feedback learns
  // less than float32.
  EXPECT_EQ(lossy->rows.size(), exact->rows.size());
  EXPECT_EQ(lossy->final_version, 10u);
  EXPECT_GT(lossy->final_eval_loss, exact->final_eval_loss);
  // Deterministic: the same CSV and summary twice.
  EXPECT_EQ(FormatCsv(*lossy), FormatCsv(*again));
  EXPECT_EQ(FormatSummary(*lossy), FormatSummary(*again));
  // Error feedback changes the pushed updates, hence the run.
  EXPECT_NE(feedback->final_eval_loss, lossy->final_eval_loss);
  EXPECT_NE(FormatCsv(*feedback), FormatCsv(*lossy));
  // Bytes: every push of the int4 runs is PushBytes' int4 count, of the float32 run the model.
  const v1::ModelSpec spec = BuildTransformerSpec(fp32.model(), fp32.apply_groups());
  EXPECT_EQ(exact->pushed_bytes, 40 * PullBytes(spec));
  EXPECT_EQ(lossy->pushed_bytes, 40 * PushBytes(spec, int4.transport()));
  EXPECT_LT(lossy->pushed_bytes * 5, exact->pushed_bytes);
  EXPECT_THAT(FormatSummary(*lossy),
              HasSubstr(absl::StrFormat(" pushed_bytes=%d ", lossy->pushed_bytes)));
}

TEST(SimulatorCodecTest, LowRankPushMovesItsEncodedBytes) {
  // blocks.0 at rank 2 with float32 factors: 6432 bytes a push instead of the model's 8320
  // (tests/unit/sim/push_codec_test.cc counts them).
  v1::ServerConfig config = OneWorkerConfig();
  v1::LayerCodec* c = config.mutable_transport()->add_layer_codecs();
  c->set_layer("blocks.0");
  c->set_codec(v1::CODEC_LOWRANK);
  c->set_rank(2);
  c->set_factor_codec(v1::CODEC_FP32);
  ASSERT_THAT(ValidateServerConfig(config), IsOk());
  ASSERT_EQ(ModelBytes(config), 8320u);
  SimulatorOptions options = Options({1});
  options.links = {SlowLink(config)};  // 8320 bytes in 4 s
  auto result = RunSynthetic(config, options);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->stop_reason, "finished");
  EXPECT_EQ(result->pushed_bytes, 3u * 6432u);
  EXPECT_EQ(result->workers[0].bytes_up, 3u * 6432u);
  EXPECT_EQ(result->workers[0].bytes_down, 3u * 8320u);
  // Each round: pull 0.1 + 4 s, 5 steps of 1 s, upload 0.1 + 4 * 6432 / 8320 s.
  const double round = 4.1 + 5 + 0.1 + 4.0 * 6432 / 8320;
  const auto rows = RowsOf(*result, 0);
  ASSERT_EQ(rows.size(), 3u);
  for (int r = 0; r < 3; ++r) EXPECT_NEAR(rows[r]->virtual_seconds, round * (r + 1), 1e-6);
}

TEST(SimulatorCodecTest, AdaptiveRankClosesTheLoopBetweenTasksAndPushes) {
  // blocks.0 low-rank from rank 1, adaptive with a window of one push: the synthetic
  // pseudo-gradients are full-rank noise, so rank-1 factors never hold 0.9 of the energy, each
  // push reports twice its rank, and the next task asks for more. The pushes grow past the
  // fixed rank-1 size only if the workers compress at the tasks' ranks and their observations
  // reach the core.
  v1::ServerConfig config = OneWorkerConfig();
  config.set_max_versions(4);
  v1::LayerCodec* c = config.mutable_transport()->add_layer_codecs();
  c->set_layer("blocks.0");
  c->set_codec(v1::CODEC_LOWRANK);
  c->set_rank(1);
  c->set_factor_codec(v1::CODEC_FP32);
  v1::ServerConfig fixed = config;
  config.mutable_transport()->mutable_adaptive_rank()->set_enabled(true);
  config.mutable_transport()->mutable_adaptive_rank()->set_window(1);
  ASSERT_THAT(ValidateServerConfig(config), IsOk());
  auto adaptive = RunSynthetic(config, Options({1}));
  auto again = RunSynthetic(config, Options({1}));
  auto constant = RunSynthetic(fixed, Options({1}));
  ASSERT_THAT(adaptive, IsOk());
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT(constant, IsOk());
  EXPECT_EQ(adaptive->rejected_per_worker[0], 0u) << absl::StrJoin(adaptive->rejections, "; ");
  EXPECT_EQ(adaptive->final_version, 4u);
  const v1::ModelSpec spec = BuildTransformerSpec(fixed.model(), fixed.apply_groups());
  EXPECT_EQ(constant->pushed_bytes, 4 * PushBytes(spec, fixed.transport()));
  // The first push is at rank 1, the later ones at higher ranks.
  EXPECT_GT(adaptive->pushed_bytes, constant->pushed_bytes);
  EXPECT_NE(FormatCsv(*adaptive), FormatCsv(*constant));
  EXPECT_EQ(FormatSummary(*adaptive), FormatSummary(*again));
  EXPECT_EQ(FormatCsv(*adaptive), FormatCsv(*again));
}

TEST(SimulatorCodecTest, GroupPushesAreEncodedPerGroup) {
  // Layer groups with int8 and error feedback: every push is its group's int8 bytes, and the
  // run differs from the float32 one.
  v1::ServerConfig config = GroupConfig(2);
  v1::ServerConfig int8 = WithCodec(config, v1::CODEC_INT8_BLOCKWISE, true);
  auto exact = RunSynthetic(config, Options({1}));
  auto lossy = RunSynthetic(int8, Options({1}));
  ASSERT_THAT(exact, IsOk());
  ASSERT_THAT(lossy, IsOk());
  EXPECT_EQ(lossy->rejected_per_worker[0], 0u);
  EXPECT_GT(lossy->updates_per_worker[0], 0u);
  EXPECT_NE(FormatCsv(*lossy), FormatCsv(*exact));
  EXPECT_LT(lossy->pushed_bytes * 3, exact->pushed_bytes);
  EXPECT_EQ(lossy->pushed_bytes, lossy->workers[0].bytes_up);
}

}  // namespace
}  // namespace aloe::sim
