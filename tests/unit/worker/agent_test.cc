// The worker agent against a fake server, a fake trainer and a fake clock: no network, no
// LibTorch, no wall clock.
#include "worker/agent.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/status_matchers.h"
#include "common/token_source.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr size_t kElements = 4;

v1::Task TrainTask(uint64_t id, uint64_t base_version, uint32_t steps = 3) {
  v1::Task task;
  task.set_kind(v1::Task::TRAIN);
  task.set_task_id(id);
  task.set_base_version(base_version);
  task.set_local_steps(steps);
  task.set_shard_name("s0");
  task.set_shard_file("s0.tok");
  return task;
}

v1::Task Kind(v1::Task::Kind kind, bool draining = false) {
  v1::Task task;
  task.set_kind(kind);
  task.set_draining(draining);
  return task;
}

// A scripted server. RequestTask and Pull answers are taken from queues (an empty queue answers
// STOP, or a pull of the version asked); every call is recorded. Thread-safe.
class FakeServer final : public ServerApi {
 public:
  struct PushCall {
    v1::PushHeader header;
    std::vector<std::vector<float>> layers;
  };

  void AddTask(absl::StatusOr<v1::Task> task, bool ahead = false) {
    absl::MutexLock lock(&mu_);
    (ahead ? ahead_tasks_ : tasks_).push_back(std::move(task));
  }
  // The next pulls' outcomes, in order (OK: a normal pull); then every pull succeeds.
  void AddPullError(absl::Status error) {
    absl::MutexLock lock(&mu_);
    pull_errors_.push_back(std::move(error));
  }
  void AddPushError(absl::Status error) {
    absl::MutexLock lock(&mu_);
    push_errors_.push_back(std::move(error));
  }
  // Blocks until a push of `task_id` has arrived (a test guard, at most 30 s).
  bool AwaitPush(uint64_t task_id) {
    absl::MutexLock lock(&mu_);
    auto pushed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const PushCall& p : pushes_) {
        if (p.header.task_id() == task_id) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&pushed), absl::Seconds(30));
  }

  absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest& request) override {
    absl::MutexLock lock(&mu_);
    ++joins_;
    v1::JoinReply reply;
    reply.set_worker_id(1);
    reply.set_lease_seconds(3600);  // no heartbeat within a test
    v1::LayerSpec* layer = reply.mutable_model_spec()->add_layers();
    layer->set_name("w");
    layer->set_num_elements(kElements);
    reply.mutable_outer_optimizer()->set_lr(0.5);
    reply.set_heldout_file("heldout.tok");
    reply.mutable_model()->set_seq_len(3);
    return reply;
  }
  absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request) override {
    return v1::HeartbeatReply();
  }
  absl::StatusOr<v1::Task> RequestTask(uint64_t worker_id, bool ahead,
                                       uint64_t dropped_task_id) override {
    absl::MutexLock lock(&mu_);
    std::deque<absl::StatusOr<v1::Task>>& queue = ahead ? ahead_tasks_ : tasks_;
    if (!ahead) dropped_.push_back(dropped_task_id);
    if (queue.empty()) return Kind(v1::Task::STOP);
    absl::StatusOr<v1::Task> task = queue.front();
    queue.pop_front();
    return task;
  }
  absl::Status ReportEval(const v1::EvalReport& report) override {
    absl::MutexLock lock(&mu_);
    evals_.push_back(report);
    return absl::OkStatus();
  }
  absl::Status Leave(uint64_t worker_id) override {
    absl::MutexLock lock(&mu_);
    ++leaves_;
    return absl::OkStatus();
  }
  absl::Status SetShards(const std::vector<std::string>&, const std::vector<std::string>&,
                         const std::string&) override {
    return absl::OkStatus();
  }
  // Fills every element with 10 x the version.
  absl::StatusOr<uint64_t> Pull(uint64_t worker_id, uint64_t version, bool latest,
                                const v1::ModelSpec& spec, std::vector<std::vector<float>>* layers,
                                uint64_t* bytes, uint32_t slice, uint32_t slices) override {
    absl::MutexLock lock(&mu_);
    pulls_.push_back(version);
    if (!pull_errors_.empty()) {
      absl::Status error = pull_errors_.front();
      pull_errors_.pop_front();
      if (!error.ok()) return error;
    }
    layers->assign(1, std::vector<float>(kElements, 10.0f * version));
    return version;
  }
  absl::StatusOr<v1::PushReply> Push(const v1::PushHeader& header, const v1::ModelSpec& spec,
                                     const std::vector<std::vector<float>>& layers,
                                     const std::vector<v1::Codec>& codecs, size_t int8_block_size,
                                     std::vector<std::vector<float>>* residuals,
                                     uint64_t* bytes) override {
    absl::MutexLock lock(&mu_);
    pushes_.push_back({header, layers});
    if (!push_errors_.empty()) {
      absl::Status error = push_errors_.front();
      push_errors_.pop_front();
      return error;
    }
    v1::PushReply reply;
    reply.set_applied(true);
    reply.set_version(header.base_version() + 1);
    return reply;
  }

  std::vector<PushCall> pushes() {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }
  std::vector<uint64_t> dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }
  std::vector<uint64_t> pulls() {
    absl::MutexLock lock(&mu_);
    return pulls_;
  }
  int joins() {
    absl::MutexLock lock(&mu_);
    return joins_;
  }
  int leaves() {
    absl::MutexLock lock(&mu_);
    return leaves_;
  }
  std::vector<v1::EvalReport> evals() {
    absl::MutexLock lock(&mu_);
    return evals_;
  }

 private:
  absl::Mutex mu_;
  std::deque<absl::StatusOr<v1::Task>> tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::StatusOr<v1::Task>> ahead_tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> pull_errors_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> push_errors_ ABSL_GUARDED_BY(mu_);
  std::vector<PushCall> pushes_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> dropped_ ABSL_GUARDED_BY(mu_);  // dropped_task_id of each RequestTask
  std::vector<uint64_t> pulls_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::EvalReport> evals_ ABSL_GUARDED_BY(mu_);
  int joins_ ABSL_GUARDED_BY(mu_) = 0;
  int leaves_ ABSL_GUARDED_BY(mu_) = 0;
};

// Each step subtracts 1 from every parameter, so a round of n steps pushes n everywhere. Stops
// at a step end once the interrupt is set. `during_step(i)` runs before step i of each round.
class FakeTrainer final : public TrainerInterface {
 public:
  struct Shared {
    std::vector<std::vector<float>> starts;  // the parameters each round started from
    std::vector<uint64_t> shards_seen;       // the data size of each round
    std::function<void(const v1::Task&, uint32_t)> during_step;
    double eval_loss = 1.5;
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
    }
    stats.tokens = stats.steps * 10;
    stats.mean_loss = 2.0;
    return stats;
  }
  absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                              std::vector<std::vector<float>>* out) const override {
    out->assign(1, std::vector<float>(kElements));
    for (size_t i = 0; i < kElements; ++i) (*out)[0][i] = base[0][i] - params_[0][i];
    return absl::OkStatus();
  }
  absl::StatusOr<double> Evaluate(const EvalRequest& request) override { return shared_.eval_loss; }

 private:
  Shared& shared_;
  std::vector<std::vector<float>> params_;
};

class AgentTest : public ::testing::Test {
 protected:
  AgentTest() : data_(std::vector<uint32_t>(100, 1), 8) {
    options_.name = "test-worker";
    options_.drop_backoff_initial = absl::Milliseconds(100);
    options_.drop_backoff_max = absl::Seconds(1);
  }

  absl::Status Run() {
    AgentEnv env;
    env.server = &server_;
    env.metrics = &metrics_;
    env.clock = &clock_;
    env.sleep = [this](absl::Duration d) {
      sleeps_.push_back(d);
      clock_.Advance(d);
    };
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

  AgentOptions options_;
  FakeServer server_;
  FakeTrainer::Shared trainer_;
  NullMetrics metrics_;
  FakeClock clock_;
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

TEST_F(AgentTest, BackoffStartsOverAfterASuccess) {
  Backoff backoff(absl::Milliseconds(100), absl::Seconds(1));
  EXPECT_EQ(backoff.Failure(), absl::ZeroDuration());
  EXPECT_EQ(backoff.Failure(), absl::Milliseconds(100));
  EXPECT_EQ(backoff.Failure(), absl::Milliseconds(200));
  backoff.Reset();
  EXPECT_EQ(backoff.Failure(), absl::ZeroDuration());
  EXPECT_EQ(backoff.Failure(), absl::Milliseconds(100));
  for (int i = 0; i < 100; ++i) backoff.Failure();
  EXPECT_EQ(backoff.Failure(), absl::Seconds(1));
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
// lr times round 1's pseudo-gradient (eager).
class AgentOverlapTest : public AgentTest,
                         public ::testing::WithParamInterface<AgentOptions::Overlap> {};

TEST_P(AgentOverlapTest, PushesRoundRWhileRoundRPlusOneTrains) {
  options_.overlap = GetParam();
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
  const float second = GetParam() == AgentOptions::Overlap::kEager ? 10 - 0.5f * 2 : 10;
  EXPECT_THAT(trainer_.starts[1], ElementsAre(second, second, second, second));
  const std::vector<FakeServer::PushCall> pushes = server_.pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.task_id(), 1u);
  EXPECT_EQ(pushes[1].header.task_id(), 2u);
  EXPECT_EQ(pushes[1].header.base_version(), 1u);
  EXPECT_EQ(server_.leaves(), 1);
}

INSTANTIATE_TEST_SUITE_P(DelayedAndEager, AgentOverlapTest,
                         ::testing::Values(AgentOptions::Overlap::kDelayed,
                                           AgentOptions::Overlap::kEager));

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

TEST_F(AgentTest, ServerUnreachableIsRetriedUntilTheConnectTimeout) {
  options_.connect_timeout = absl::Seconds(1);
  options_.retry_interval = absl::Milliseconds(250);
  for (int i = 0; i < 10; ++i) server_.AddTask(absl::UnavailableError("connection refused"));
  const absl::Status status = Run();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("connection refused")));
  // Tries at 0, 0.25, 0.5, 0.75, 1.0 and 1.25 s: the last one is past the timeout.
  EXPECT_EQ(sleeps_.size(), 5u);
  EXPECT_EQ(server_.leaves(), 0);  // the server's failure is not the worker's: no leave
}

}  // namespace
}  // namespace aloe::worker
