// The worker agent against a fake server, a fake trainer and a fake clock: no network, no
// LibTorch, no wall clock. The heartbeat thread waits on the fake clock too (FakeSleeper).
#include "worker/agent.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/durable_file.h"
#include "common/metrics.h"
#include "common/status_matchers.h"
#include "common/token_source.h"
#include "tests/unit/worker/fake_server.h"
#include "worker/inner_state_store.h"
#include "worker/round_boundary.h"
#include "worker/sleeper.h"
#include "worker/worker_metrics.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Each step subtracts 1 from every parameter, so a round of n steps pushes n everywhere. Stops
// at a step end once the interrupt is set. `during_step(i)` runs before step i of each round.
class FakeTrainer final : public TrainerInterface {
 public:
  struct Shared {
    std::vector<std::vector<float>> starts;  // the parameters each round started from
    std::vector<uint64_t> shards_seen;       // the data size of each round
    std::function<void(const v1::Task&, uint32_t)> during_step;
    double eval_loss = 1.5;
    std::vector<uint64_t> restored;  // the steps of each inner state restored
    // Offers a device round boundary: the host one, recording each call and its thread.
    bool device_boundary = false;
    std::vector<std::pair<std::string, std::thread::id>> boundary_calls;
    // Runs in each call to that boundary on the agent's thread (StartStaged, EndRound).
    std::function<void()> in_round_boundary;
  };
  explicit FakeTrainer(Shared& shared) : shared_(shared) {}

  absl::Status SetParameters(const std::vector<std::vector<float>>& layers) override {
    params_ = layers;
    return absl::OkStatus();
  }
  absl::StatusOr<TrainStats> Train(const TrainRequest& request) override {
    shared_.starts.push_back(params_[0]);
    shared_.shards_seen.push_back(request.data->num_tokens());
    TrainStats stats;
    for (uint32_t i = 0; i < request.steps; ++i) {
      if (request.interrupt != nullptr && request.interrupt->load()) break;
      if (shared_.during_step) shared_.during_step(v1::Task(), i);
      for (float& p : params_[0]) p -= 1;
      ++stats.steps;
      ++inner_steps_;
    }
    stats.tokens = stats.steps * 10;
    stats.mean_loss = 2.0;
    return stats;
  }
  absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                              std::vector<std::vector<float>>* out) const override {
    out->assign(1, std::vector<float>(kFakeElements));
    for (size_t i = 0; i < kFakeElements; ++i) (*out)[0][i] = base[0][i] - params_[0][i];
    return absl::OkStatus();
  }
  absl::StatusOr<double> Evaluate(const EvalRequest& request) override { return shared_.eval_loss; }
  RoundBoundary* device_round_boundary() override {
    if (!shared_.device_boundary) return nullptr;
    if (boundary_ == nullptr) boundary_ = std::make_unique<RecordingBoundary>(this, shared_);
    return boundary_.get();
  }
  // The inner state is the step count, in both moments.
  absl::StatusOr<InnerState> SaveInnerState() const override {
    const float steps = static_cast<float>(inner_steps_);
    return InnerState{inner_steps_, {{steps}}, {{steps}}};
  }
  absl::Status RestoreInnerState(const InnerState& state) override {
    inner_steps_ = state.steps;
    shared_.restored.push_back(state.steps);
    return absl::OkStatus();
  }

 private:
  class RecordingBoundary final : public RoundBoundary {
   public:
    RecordingBoundary(TrainerInterface* trainer, Shared& shared)
        : host_(trainer), shared_(shared) {}
    absl::Status StageStart(std::vector<std::vector<float>> layers) override {
      Note("stage");
      return host_.StageStart(std::move(layers));
    }
    absl::Status StartStaged(float delta_scale) override {
      Note("start");
      if (shared_.in_round_boundary) shared_.in_round_boundary();
      return host_.StartStaged(delta_scale);
    }
    absl::Status EndRound() override {
      Note("end");
      if (shared_.in_round_boundary) shared_.in_round_boundary();
      return host_.EndRound();
    }
    absl::Status TakePseudoGradient(std::vector<std::vector<float>>* out) override {
      Note("take");
      return host_.TakePseudoGradient(out);
    }

   private:
    void Note(const char* call) {
      std::lock_guard<std::mutex> lock(mu_);
      shared_.boundary_calls.emplace_back(call, std::this_thread::get_id());
    }
    HostRoundBoundary host_;
    Shared& shared_;
    std::mutex mu_;
  };

  Shared& shared_;
  uint64_t inner_steps_ = 0;
  std::vector<std::vector<float>> params_;
  std::unique_ptr<RecordingBoundary> boundary_;
};

class AgentTest : public ::testing::Test {
 protected:
  AgentTest() : data_(std::vector<uint32_t>(100, 1), 8) {
    options_.name = "test-worker";
    options_.drop_backoff_initial = absl::Milliseconds(100);
    options_.drop_backoff_max = absl::Seconds(1);
    // Exact waits; the jitter has its own tests.
    options_.retry_jitter = 0;
  }

  absl::Status Run(MetricsSink* metrics = nullptr) {
    AgentEnv env;
    env.server = &server_;
    env.metrics = metrics != nullptr ? metrics : &metrics_;
    env.clock = &clock_;
    env.sleep = [this](absl::Duration d) {
      sleeps_.push_back(d);
      sleeper_.Advance(d);
    };
    env.sleeper = &sleeper_;
    env.stop = &stop_;
    env.make_trainer =
        [this](const v1::JoinReply&) -> absl::StatusOr<std::unique_ptr<TrainerInterface>> {
      return std::make_unique<FakeTrainer>(trainer_);
    };
    env.open_shard = [this](const std::string& file) -> absl::StatusOr<const TokenSource*> {
      return &data_;
    };
    Agent agent(options_, std::move(env));
    return agent.Run();
  }

  // A shard process away for 30 s under capped, jittered drop waits: every request hands out
  // task 1 until it is pushed (then STOP), and its pulls fail until then. Returns when the shard
  // is back; *resumed becomes the time the task's first step began.
  absl::Time ShardAwayForHalfAMinute(absl::Time* resumed) {
    options_.drop_backoff_initial = absl::Milliseconds(100);
    options_.drop_backoff_max = absl::Seconds(5);
    options_.retry_jitter = 0.5;
    options_.retry_seed = 7;
    const absl::Time back = clock_.Now() + absl::Seconds(30);
    server_.SetPullOutage(&clock_, back, absl::UnavailableError("shard 0 (x): connection refused"));
    server_.set_task_source([](size_t pushes) -> absl::StatusOr<v1::Task> {
      return pushes == 0 ? TrainTask(1, 0) : Kind(v1::Task::STOP);
    });
    trainer_.during_step = [this, resumed](const v1::Task&, uint32_t step) {
      if (step == 0) *resumed = clock_.Now();
    };
    return back;
  }

  AgentOptions options_;
  FakeServer server_;
  FakeTrainer::Shared trainer_;
  NullMetrics metrics_;
  FakeClock clock_;
  FakeSleeper sleeper_{clock_};
  std::vector<absl::Duration> sleeps_;
  std::atomic<bool> stop_{false};
  InMemoryTokenSource data_;
};

TEST_F(AgentTest, StopTaskLeavesAndEndsTheRun) {
  server_.AddTask(Kind(v1::Task::STOP));
  EXPECT_THAT(Run(), IsOk());
  EXPECT_EQ(server_.joins(), 1);
  EXPECT_EQ(server_.leaves(), 1);
  EXPECT_TRUE(trainer_.starts.empty());
  EXPECT_TRUE(server_.pushes().empty());
}

TEST_F(AgentTest, TrainsPullsAndPushesTheRoundsPseudoGradient) {
  server_.AddTask(TrainTask(4, /*base_version=*/2, /*steps=*/3));
  EXPECT_THAT(Run(), IsOk());
  EXPECT_THAT(server_.pulls(), ElementsAre(2));
  ASSERT_EQ(trainer_.starts.size(), 1u);
  EXPECT_THAT(trainer_.starts[0], ElementsAre(20, 20, 20, 20));
  EXPECT_THAT(trainer_.shards_seen, ElementsAre(100));
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].header.task_id(), 4u);
  EXPECT_EQ(pushes[0].header.base_version(), 2u);
  EXPECT_EQ(pushes[0].header.steps_done(), 3u);
  EXPECT_EQ(pushes[0].header.tokens_learned(), 30u);
  EXPECT_THAT(pushes[0].layers[0], ElementsAre(3, 3, 3, 3));  // theta_base - theta_end
  EXPECT_EQ(server_.leaves(), 1);
}

TEST_F(AgentTest, WaitAsksAgainWithoutTrainingOrBackingOff) {
  server_.AddTask(Kind(v1::Task::WAIT, /*draining=*/true));
  server_.AddTask(Kind(v1::Task::WAIT));
  server_.AddTask(TrainTask(9, 0));
  EXPECT_THAT(Run(), IsOk());
  EXPECT_EQ(server_.dropped().size(), 4u);  // WAIT, WAIT, TRAIN, STOP
  EXPECT_EQ(trainer_.starts.size(), 1u);
  EXPECT_EQ(server_.pushes().size(), 1u);
  EXPECT_TRUE(sleeps_.empty());
}

TEST_F(AgentTest, TaskDroppedOnFailedPreconditionIsGivenUpInTheNextRequest) {
  server_.AddTask(TrainTask(7, 3));
  server_.AddPullError(absl::FailedPreconditionError("version 3 is no longer held"));
  server_.AddTask(TrainTask(8, 5));
  EXPECT_THAT(Run(), IsOk());
  // The request after task 7 names it; the one after task 8 (pushed) names none.
  EXPECT_THAT(server_.dropped(), ElementsAre(0, 7, 0));
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].header.task_id(), 8u);
}

TEST_F(AgentTest, LostPushIsRetriedWhenTheServerHandsTheTaskOutAgain) {
  server_.AddTask(TrainTask(5, 1));
  server_.AddPushError(absl::UnavailableError("connection refused"));
  server_.AddTask(TrainTask(5, 1));
  EXPECT_THAT(Run(), IsOk());
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.task_id(), 5u);
  EXPECT_EQ(pushes[1].header.task_id(), 5u);
  EXPECT_EQ(pushes[1].header.update_id(), pushes[0].header.update_id() + 1);
  EXPECT_THAT(pushes[1].layers[0], ElementsAre(3, 3, 3, 3));
  // kUnavailable does not give the task up, and a single drop does not wait.
  EXPECT_THAT(server_.dropped(), ElementsAre(0, 0, 0));
  EXPECT_TRUE(sleeps_.empty());
}

TEST_F(AgentTest, StopRequestPushesTheStepsDoneAndLeaves) {
  server_.AddTask(TrainTask(6, 0, /*steps=*/10));
  server_.AddTask(TrainTask(7, 1));  // never asked for
  trainer_.during_step = [this](const v1::Task&, uint32_t step) {
    if (step == 1) stop_.store(true);  // SIGTERM during the second step
  };
  EXPECT_THAT(Run(), IsOk());
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_EQ(pushes[0].header.steps_done(), 2u);
  EXPECT_THAT(pushes[0].layers[0], ElementsAre(2, 2, 2, 2));
  EXPECT_EQ(server_.dropped().size(), 1u);  // no request after the stop
  EXPECT_EQ(server_.leaves(), 1);
}

TEST_F(AgentTest, RepeatedDropsBackOffExponentiallyUpToTheCapAndResetOnSuccess) {
  // Task 1 is dropped 7 times in a row (a shard process is down), then pulled and pushed; then
  // task 2 is dropped once (no wait: the success reset the backoff) and pushed.
  for (int i = 0; i < 8; ++i) server_.AddTask(TrainTask(1, 0));
  for (int i = 0; i < 7; ++i) {
    server_.AddPullError(absl::UnavailableError("shard process 1: connection refused"));
  }
  server_.AddPullError(absl::OkStatus());
  server_.AddPullError(absl::UnavailableError("shard process 1: connection refused"));
  server_.AddTask(TrainTask(2, 1));
  server_.AddTask(TrainTask(2, 1));
  EXPECT_THAT(Run(), IsOk());
  using absl::Milliseconds;
  EXPECT_THAT(sleeps_, ElementsAre(Milliseconds(100), Milliseconds(200), Milliseconds(400),
                                   Milliseconds(800), Milliseconds(1000), Milliseconds(1000)));
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.task_id(), 1u);
  EXPECT_EQ(pushes[1].header.task_id(), 2u);
}

TEST_F(AgentTest, AShardAwayForHalfAMinuteIsAskedForAFewTimesThenTrainedOnAtOnce) {
  // Every request hands out task 1 until it is pushed; its pulls fail while the shard process is
  // away (30 s). A loop without pause asks once per round trip, without end on this clock.
  absl::Time resumed = absl::InfinitePast();
  const absl::Time back = ShardAwayForHalfAMinute(&resumed);
  RecordingMetrics metrics;
  ::testing::internal::CaptureStderr();
  EXPECT_THAT(Run(&metrics), IsOk());
  const std::string log = ::testing::internal::GetCapturedStderr();
  const size_t attempts = server_.pulls().size();
  RecordProperty("attempts", static_cast<int>(attempts));
  // Waits 0, then 0.1, 0.2, ... 3.2 s, then 5 s, each jittered down by up to half: 12 failed
  // tries (no jitter) to 18 (all halved) until the shard is back, then the one that trains.
  EXPECT_GE(attempts, 13u);
  EXPECT_LE(attempts, 19u);
  EXPECT_EQ(server_.requesters().size(), attempts + 1);  // and the STOP
  ASSERT_EQ(sleeps_.size(), attempts - 2);               // the first drop asks again at once
  for (size_t i = 0; i < sleeps_.size(); ++i) {
    const absl::Duration ceiling =
        std::min(absl::Milliseconds(100) * (1 << std::min<size_t>(i, 10)), absl::Seconds(5));
    EXPECT_GE(sleeps_[i], ceiling / 2) << i;
    EXPECT_LE(sleeps_[i], ceiling) << i;
  }
  // Resumed within one capped wait of the shard's return, and pushed.
  EXPECT_GE(resumed, back);
  EXPECT_LE(resumed, back + absl::Seconds(5));
  ASSERT_EQ(server_.pushes().size(), 1u);
  EXPECT_EQ(metrics.Value(kRetries, {"task"}), static_cast<double>(attempts - 1));
  EXPECT_EQ(metrics.Value(kRetryBackoff), 0);  // reset by the completed round
  // The drops are logged once, then within the 10 s log interval at most 3 more times.
  size_t lines = 0;
  for (size_t at = log.find("task 1 dropped"); at != std::string::npos;
       at = log.find("task 1 dropped", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 4u) << log;
}

TEST_F(AgentTest, DropLogIsBoundedAndCountsWhatItSkipped) {
  // Drops at t = 0 (logged), 0, 0.1 (skipped) and 0.3 s (logged, with the count).
  options_.drop_log_interval = absl::Milliseconds(250);
  for (int i = 0; i < 4; ++i) {
    server_.AddTask(TrainTask(1, 0));
    server_.AddPullError(absl::UnavailableError("refused"));
  }
  ::testing::internal::CaptureStderr();
  EXPECT_THAT(Run(), IsOk());
  const std::string log = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t at = log.find("dropped: refused"); at != std::string::npos;
       at = log.find("dropped: refused", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 2u) << log;
  EXPECT_THAT(log, HasSubstr("(2 more dropped since the last note; asking again in 0.40 s)"));
}

// Overlapped rounds: round 2 trains while round 1's push is in flight (its training waits for
// that push), from the base the look-ahead pull fetched (delayed) or that base minus the outer
// lr times round 1's pseudo-gradient (eager). The boundary between the rounds runs on the host
// (SetParameters, PseudoGradient) or through the trainer's own device boundary, alike.
class AgentOverlapTest : public AgentTest,
                         public ::testing::WithParamInterface<
                             std::tuple<AgentOptions::Overlap, AgentOptions::Boundary>> {};

TEST_P(AgentOverlapTest, PushesRoundRWhileRoundRPlusOneTrains) {
  const auto [overlap, boundary] = GetParam();
  options_.overlap = overlap;
  options_.round_boundary = boundary;
  trainer_.device_boundary = true;  // offered; used only when asked for
  server_.AddTask(TrainTask(1, /*base_version=*/0, /*steps=*/2));
  server_.AddTask(TrainTask(2, /*base_version=*/1, /*steps=*/2), /*ahead=*/true);
  server_.AddTask(Kind(v1::Task::STOP), /*ahead=*/true);
  int rounds_started = 0;
  bool pushed_while_training = false;
  trainer_.during_step = [&](const v1::Task&, uint32_t step) {
    if (step != 0) return;
    if (++rounds_started == 2) pushed_while_training = server_.AwaitPush(1);
  };
  EXPECT_THAT(Run(), IsOk());
  EXPECT_TRUE(pushed_while_training);
  EXPECT_THAT(server_.pulls(), ElementsAre(0, 1));
  ASSERT_EQ(trainer_.starts.size(), 2u);
  EXPECT_THAT(trainer_.starts[0], ElementsAre(0, 0, 0, 0));
  // Round 1 pushed 2 everywhere; the outer lr is 0.5.
  const float second = overlap == AgentOptions::Overlap::kEager ? 10 - 0.5f * 2 : 10;
  EXPECT_THAT(trainer_.starts[1], ElementsAre(second, second, second, second));
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.task_id(), 1u);
  EXPECT_EQ(pushes[1].header.task_id(), 2u);
  EXPECT_EQ(pushes[1].header.base_version(), 1u);
  EXPECT_EQ(server_.leaves(), 1);
  // The trainer's boundary when asked for (auto means the host on a CPU): round 2's start is
  // staged while round 1 trains, round 1's pseudo-gradient taken while round 2 trains, both on
  // the background thread; the last round's is taken for its push at once.
  std::vector<std::string> main_calls, background_calls;
  for (const auto& [call, thread] : trainer_.boundary_calls) {
    (thread == std::this_thread::get_id() ? main_calls : background_calls).push_back(call);
  }
  if (boundary == AgentOptions::Boundary::kDevice) {
    EXPECT_THAT(main_calls, ElementsAre("stage", "start", "end", "start", "end", "take"));
    EXPECT_THAT(background_calls, ElementsAre("stage", "take"));
    // Round 1's pseudo-gradient is out before round 2's end overwrites it.
    std::vector<std::string> order;
    for (const auto& call : trainer_.boundary_calls) order.push_back(call.first);
    const auto first_take = std::find(order.begin(), order.end(), "take");
    const auto second_end =
        std::find(std::find(order.begin(), order.end(), "end") + 1, order.end(), "end");
    EXPECT_LT(first_take, second_end) << ::testing::PrintToString(order);
  } else {
    EXPECT_TRUE(trainer_.boundary_calls.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(DelayedAndEager, AgentOverlapTest,
                         ::testing::Combine(::testing::Values(AgentOptions::Overlap::kDelayed,
                                                              AgentOptions::Overlap::kEager),
                                            ::testing::Values(AgentOptions::Boundary::kAuto,
                                                              AgentOptions::Boundary::kHost,
                                                              AgentOptions::Boundary::kDevice)));

// The time the rounds spend in the boundary, outside the steps, is counted: here each start and
// each end of a round takes 0.25 s of the fake clock, two rounds 1 s.
TEST_F(AgentTest, CountsTheTimeSpentInTheRoundBoundary) {
  options_.overlap = AgentOptions::Overlap::kEager;
  options_.round_boundary = AgentOptions::Boundary::kDevice;
  trainer_.device_boundary = true;
  trainer_.in_round_boundary = [this] { clock_.Advance(absl::Milliseconds(250)); };
  server_.AddTask(TrainTask(1, /*base_version=*/0, /*steps=*/2));
  server_.AddTask(TrainTask(2, /*base_version=*/1, /*steps=*/2), /*ahead=*/true);
  server_.AddTask(Kind(v1::Task::STOP), /*ahead=*/true);
  RecordingMetrics metrics;
  ::testing::internal::CaptureStderr();
  EXPECT_THAT(Run(&metrics), IsOk());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(metrics.Value(kRounds), 2);
  EXPECT_DOUBLE_EQ(metrics.Value(kBoundarySeconds), 1.0);
  EXPECT_THAT(log, HasSubstr("boundary_seconds=1.000"));
  EXPECT_THAT(log, HasSubstr("the round boundary runs on the trainer's device"));
}

TEST_F(AgentTest, EvaluatorReportsTheHeldOutLossOfTheVersion) {
  options_.evaluator = true;
  options_.eval_sequences = 4;
  v1::Task eval = Kind(v1::Task::EVAL);
  eval.set_task_id(3);
  eval.set_base_version(2);
  server_.AddTask(eval);
  trainer_.eval_loss = 0.75;
  EXPECT_THAT(Run(), IsOk());
  const std::vector<v1::EvalReport> evals = server_.evals();
  ASSERT_EQ(evals.size(), 1u);
  EXPECT_EQ(evals[0].version(), 2u);
  EXPECT_DOUBLE_EQ(evals[0].loss(), 0.75);
  EXPECT_EQ(evals[0].tokens(), 4u * 3);  // 4 windows of seq_len 3 (100 tokens hold 25)
}

TEST_F(AgentTest, ExpiredLeaseJoinsAgain) {
  server_.AddTask(absl::NotFoundError("worker 1 is not a member (lease expired)"));
  server_.AddTask(TrainTask(2, 0));
  EXPECT_THAT(Run(), IsOk());
  EXPECT_EQ(server_.joins(), 2);
  EXPECT_EQ(server_.pushes().size(), 1u);
}

TEST_F(AgentTest, AShardBackFromAnOutageIsTrainedOnAsSoonAsItsConnectionIsUp) {
  // As above, but the server API waits for the shard's connection (ServerClient::AwaitServers):
  // the backoff wait ends when the shard is back instead of a whole capped wait later.
  absl::Time resumed = absl::InfinitePast();
  const absl::Time back = ShardAwayForHalfAMinute(&resumed);
  std::vector<absl::Duration> awaited;
  server_.set_await_servers([&](absl::Duration wait) {
    awaited.push_back(wait);
    const absl::Duration left = back - clock_.Now();
    if (left <= absl::ZeroDuration()) return wait;  // every connection up: sleep it all
    sleeper_.Advance(std::min(wait, left));
    return absl::ZeroDuration();
  });
  EXPECT_THAT(Run(), IsOk());
  EXPECT_EQ(resumed, back);  // not up to 5 s later
  EXPECT_TRUE(sleeps_.empty());
  // The same capped, jittered waits bound the tries while the shard is away.
  const size_t attempts = server_.pulls().size();
  EXPECT_GE(attempts, 13u);
  EXPECT_LE(attempts, 19u);
  ASSERT_EQ(awaited.size(), attempts - 2);
  EXPECT_LE(awaited.back(), absl::Seconds(5));
  ASSERT_EQ(server_.pushes().size(), 1u);
}

TEST_F(AgentTest, ServerUnreachableIsRetriedUntilTheConnectTimeout) {
  options_.connect_timeout = absl::Seconds(1);
  options_.retry_interval = absl::Milliseconds(250);
  for (int i = 0; i < 10; ++i) server_.AddTask(absl::UnavailableError("connection refused"));
  RecordingMetrics metrics;
  const absl::Status status = Run(&metrics);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("connection refused")));
  // Tries at 0, 0.25, 0.75 and 1.75 s (the waits double): the last one is past the timeout.
  EXPECT_THAT(sleeps_,
              ElementsAre(absl::Milliseconds(250), absl::Milliseconds(500), absl::Seconds(1)));
  EXPECT_EQ(metrics.Value(kRetries, {"request"}), 3);
  EXPECT_EQ(server_.leaves(), 0);  // the server's failure is not the worker's: no leave
}

TEST_F(AgentTest, ARestartedServerIsAskedAgainOnceItsConnectionIsUp) {
  options_.retry_interval = absl::Milliseconds(250);
  for (int i = 0; i < 2; ++i) server_.AddTask(absl::UnavailableError("connection refused"));
  server_.AddTask(Kind(v1::Task::STOP));
  std::vector<absl::Duration> awaited;
  server_.set_await_servers([&](absl::Duration wait) {
    awaited.push_back(wait);
    return absl::ZeroDuration();  // the connection came up: no sleep after it
  });
  EXPECT_THAT(Run(), IsOk());
  EXPECT_THAT(awaited, ElementsAre(absl::Milliseconds(250), absl::Milliseconds(500)));
  EXPECT_TRUE(sleeps_.empty());
}

// The heartbeat thread waits on the fake clock: a test advances it from inside a round (the
// fake trainer's step) and counts the heartbeats that follow.

TEST_F(AgentTest, HeartbeatsGoOutEveryThirdOfTheLeaseWithTheLastRoundsSpeed) {
  server_.set_lease_seconds(6);  // a heartbeat every 2 s
  server_.AddTask(TrainTask(1, 0, /*steps=*/2));
  server_.AddTask(TrainTask(2, 1, /*steps=*/2));
  int round = 0;
  uint64_t waits = 1;  // the heartbeat's first wait begins at the join
  trainer_.during_step = [&](const v1::Task&, uint32_t step) {
    if (step != 0) return;
    // Round 1 lasts 10 s (a heartbeat at 2, 4, ..., 10 s); round 2 sees one more at 12 s.
    const int seconds = ++round == 1 ? 10 : 2;
    for (int s = 1; s <= seconds; ++s) {
      ASSERT_TRUE(sleeper_.AwaitWaits(waits));
      sleeper_.Advance(absl::Seconds(1));
      if (s % 2 == 0) ++waits;  // the heartbeat went out and the next wait began
    }
    ASSERT_TRUE(sleeper_.AwaitWaits(waits));
  };
  EXPECT_THAT(Run(), IsOk());
  const std::vector<v1::HeartbeatRequest> heartbeats = server_.heartbeats();
  ASSERT_EQ(heartbeats.size(), 6u);
  for (size_t i = 0; i < heartbeats.size(); ++i) {
    EXPECT_EQ(heartbeats[i].worker_id(), 1u);
    // Round 1 took its 2 steps in 10 s; nothing is known before it ends.
    EXPECT_DOUBLE_EQ(heartbeats[i].steps_per_second(), i < 5 ? 0 : 0.2) << i;
  }
}

TEST_F(AgentTest, HeartbeatAnsweredNotFoundJoinsAgainBeforeTheNextRequest) {
  server_.set_lease_seconds(3);  // a heartbeat every 1 s
  server_.SetHeartbeatError(1, absl::NotFoundError("worker 1 is not a member"));
  server_.AddTask(TrainTask(1, 0));
  server_.AddTask(TrainTask(2, 1));
  bool lost = false;
  trainer_.during_step = [&](const v1::Task&, uint32_t step) {
    if (step != 0 || lost) return;
    lost = true;
    ASSERT_TRUE(sleeper_.AwaitWaits(1));
    sleeper_.Advance(absl::Seconds(1));
    ASSERT_TRUE(sleeper_.AwaitWaits(2));  // the answer has been taken in
  };
  EXPECT_THAT(Run(), IsOk());
  EXPECT_EQ(server_.joins(), 2);
  // Worker 1 asked for task 1; the rejoined worker 2 for task 2 and then got STOP.
  EXPECT_THAT(server_.requesters(), ElementsAre(1, 2, 2));
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.worker_id(), 1u);
  EXPECT_EQ(pushes[1].header.worker_id(), 2u);
  EXPECT_EQ(pushes[1].header.task_id(), 2u);
}

TEST_F(AgentTest, HeartbeatStopsWhenAStoppingAgentLeaves) {
  server_.set_lease_seconds(3);  // a heartbeat every 1 s
  server_.AddTask(TrainTask(1, 0, /*steps=*/10));
  trainer_.during_step = [&](const v1::Task&, uint32_t step) {
    if (step != 0) return;
    ASSERT_TRUE(sleeper_.AwaitWaits(1));
    sleeper_.Advance(absl::Seconds(1));
    ASSERT_TRUE(sleeper_.AwaitWaits(2));
    stop_.store(true);  // SIGTERM while the heartbeat waits for its next turn
  };
  // Returns although no time passes: leaving ends the heartbeat's wait.
  EXPECT_THAT(Run(), IsOk());
  EXPECT_EQ(server_.leaves(), 1);
  ASSERT_EQ(server_.pushes().size(), 1u);
  EXPECT_EQ(server_.heartbeats().size(), 1u);
  sleeper_.Advance(absl::Hours(1));
  EXPECT_EQ(server_.heartbeats().size(), 1u);
  EXPECT_EQ(sleeper_.waits(), 2u);
}

class AgentInnerStateTest : public AgentTest {
 protected:
  AgentInnerStateTest() {
    dir_ = ::testing::TempDir() + "/inner_state_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" +
           std::to_string(getpid());
    options_.state_dir = dir_;
  }
  InnerStateStore Store(uint32_t spec_digest) const {
    return InnerStateStore(dir_, {spec_digest, /*rank=*/0, /*ranks=*/1});
  }
  uint32_t FakeDigest() {
    return ModelSpecDigest(server_.Join(v1::JoinRequest()).value().model_spec());
  }
  std::string dir_;
};

TEST_F(AgentInnerStateTest, AWorkerRestartedOnTheSameDirectoryGoesOnWithItsMoments) {
  const uint32_t digest = FakeDigest();
  server_.AddTask(TrainTask(1, 0, /*steps=*/3));
  server_.AddTask(TrainTask(2, 1, /*steps=*/4));
  RecordingMetrics first;
  ASSERT_THAT(Run(&first), IsOk());
  EXPECT_EQ(first.Value(kInnerStateSaves, {"saved"}), 2);  // after each round
  EXPECT_EQ(first.Value(kInnerStateRestores, {"none"}), 1);
  EXPECT_TRUE(trainer_.restored.empty());
  absl::StatusOr<InnerState> saved = Store(digest).Load();
  ASSERT_THAT(saved.status(), IsOk());
  EXPECT_EQ(saved->steps, 7u);
  EXPECT_THAT(saved->first, ElementsAre(ElementsAre(7.0f)));

  // The restarted worker (a new agent and trainer) starts from the 7 steps.
  server_.AddTask(TrainTask(3, 2, /*steps=*/2));
  RecordingMetrics second;
  ASSERT_THAT(Run(&second), IsOk());
  EXPECT_THAT(trainer_.restored, ElementsAre(7u));
  EXPECT_EQ(second.Value(kInnerStateRestores, {"restored"}), 1);
  EXPECT_EQ(Store(digest).Load()->steps, 9u);
}

TEST_F(AgentInnerStateTest, EveryNRoundsAndOnceMoreWhenLeaving) {
  options_.state_every_rounds = 2;
  for (int i = 1; i <= 3; ++i) server_.AddTask(TrainTask(i, i - 1, /*steps=*/1));
  RecordingMetrics metrics;
  ASSERT_THAT(Run(&metrics), IsOk());
  // After round 2, then at the STOP for round 3.
  EXPECT_EQ(metrics.Value(kInnerStateSaves, {"saved"}), 2);
  EXPECT_EQ(Store(FakeDigest()).Load()->steps, 3u);
}

TEST_F(AgentInnerStateTest, AStateOfAnotherModelIsRefusedAndTheWorkerStartsFresh) {
  ASSERT_THAT(Store(FakeDigest() + 1).Save(InnerState{5, {{1}}, {{1}}}), IsOk());
  server_.AddTask(TrainTask(1, 0, /*steps=*/2));
  RecordingMetrics metrics;
  ASSERT_THAT(Run(&metrics), IsOk());
  EXPECT_TRUE(trainer_.restored.empty());
  EXPECT_EQ(metrics.Value(kInnerStateRestores, {"refused"}), 1);
  // The round's state replaces the other model's.
  EXPECT_EQ(Store(FakeDigest()).Load()->steps, 2u);
}

TEST_F(AgentInnerStateTest, SavesThatFailDoNotStopTraining) {
  // The directory cannot be made: a file is in its place.
  ASSERT_THAT(WriteFileAtomically(dir_, "not a directory"), IsOk());
  server_.AddTask(TrainTask(1, 0, /*steps=*/2));
  server_.AddTask(TrainTask(2, 1, /*steps=*/2));
  RecordingMetrics metrics;
  ASSERT_THAT(Run(&metrics), IsOk());
  EXPECT_EQ(server_.pushes().size(), 2u);
  // Each round, and the leave (the rounds are still unsaved).
  EXPECT_EQ(metrics.Value(kInnerStateSaves, {"failed"}), 3);
  EXPECT_EQ(metrics.Value(kInnerStateSaves, {"saved"}), 0);
}

TEST(AgentOptionsTest, StateOptionsAreChecked) {
  AgentOptions options;
  options.state_every_rounds = 0;
  EXPECT_THAT(ValidateAgentOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--state_every_rounds")));
  options.state_every_rounds = 1;
  options.evaluator = true;
  options.state_dir = "/tmp/x";
  EXPECT_THAT(ValidateAgentOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--state_dir")));
}

}  // namespace
}  // namespace aloe::worker
