// Streaming rounds (partial synchronization) against a fake server that keeps layer groups and
// a fake trainer: which group is pushed after which step, against which version, what is
// pushed and how the returned global values are merged. No network, no LibTorch, no wall clock.
#include "worker/streaming_round.h"

#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/status_matchers.h"
#include "common/sync_schedule.h"
#include "common/token_source.h"
#include "worker/agent.h"
#include "worker/server_session.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr size_t kElements = 2;  // per layer
constexpr float kStart = 5.0f;   // every initial parameter

// A server with layer groups: one layer per group, each with its own version. A push of group g
// is applied at once as theta_g -= g_pushed (outer SGD at learning rate 1), so with mixing
// alpha 0 the merged values are exactly the worker's own. StartGroup answers WAIT as often as
// scripted before it grants. Thread-safe.
class GroupServer final : public ServerApi {
 public:
  struct PushCall {
    v1::PushHeader header;
    std::vector<std::vector<float>> layers;
  };

  GroupServer(uint32_t groups, v1::PartialSyncConfig partial_sync)
      : groups_(groups),
        partial_sync_(std::move(partial_sync)),
        params_(groups, std::vector<float>(kElements, kStart)),
        versions_(groups, 0) {
    partial_sync_.set_groups(groups);
  }

  void AddTask(v1::Task task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }
  void AddPushError(absl::Status error) {
    absl::MutexLock lock(&mu_);
    push_errors_.push_back(std::move(error));
  }
  // The next push that ends a task (no task_continues) is refused with `error`.
  void AddEndError(absl::Status error) {
    absl::MutexLock lock(&mu_);
    end_errors_.push_back(std::move(error));
  }
  // The next `n` StartGroup calls of `group` answer WAIT.
  void AddWaits(uint32_t group, int n) {
    absl::MutexLock lock(&mu_);
    waits_[group] += n;
  }
  void StopTraining() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }
  // Every pull and push of a group takes `transfer` on `clock`.
  void SetTransferTime(FakeClock* clock, absl::Duration transfer) {
    absl::MutexLock lock(&mu_);
    clock_ = clock;
    transfer_ = transfer;
  }

  v1::JoinReply JoinReply() const {
    v1::JoinReply reply;
    reply.set_worker_id(1);
    reply.set_lease_seconds(3600);
    for (uint32_t g = 0; g < groups_; ++g) {
      v1::LayerSpec* layer = reply.mutable_model_spec()->add_layers();
      layer->set_id(g);
      layer->set_name("layer" + std::to_string(g));
      layer->set_num_elements(kElements);
      reply.add_layer_groups(g);
    }
    *reply.mutable_partial_sync() = partial_sync_;
    reply.set_heldout_file("heldout.tok");
    reply.mutable_model()->set_seq_len(3);
    return reply;
  }

  absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest&) override { return JoinReply(); }
  absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest&) override {
    return v1::HeartbeatReply();
  }
  absl::StatusOr<v1::Task> RequestTask(uint64_t, bool ahead, uint64_t given_up) override {
    absl::MutexLock lock(&mu_);
    requests_.emplace_back(ahead, given_up);
    v1::Task task;
    task.set_kind(v1::Task::STOP);
    if (tasks_.empty()) return task;
    task = tasks_.front();
    tasks_.pop_front();
    return task;
  }
  absl::Status ReportEval(const v1::EvalReport&) override { return absl::OkStatus(); }
  absl::Status Leave(uint64_t) override {
    absl::MutexLock lock(&mu_);
    ++leaves_;
    return absl::OkStatus();
  }
  absl::Status SetShards(const std::vector<std::string>&, const std::vector<std::string>&,
                         const std::string&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> Pull(uint64_t, uint64_t, bool, const v1::ModelSpec&,
                                std::vector<std::vector<float>>*, uint64_t*, uint32_t,
                                uint32_t) override {
    return absl::UnimplementedError("whole-model pull under layer groups");
  }
  absl::StatusOr<v1::PushReply> Push(const v1::PushHeader&, const v1::ModelSpec&,
                                     const std::vector<std::vector<float>>&,
                                     const std::vector<v1::Codec>&, const BlockSizes&,
                                     std::vector<std::vector<float>>*, uint64_t*) override {
    return absl::UnimplementedError("whole-model push under layer groups");
  }
  absl::StatusOr<v1::Task> StartGroup(uint64_t, uint32_t group) override {
    absl::MutexLock lock(&mu_);
    starts_.push_back(group);
    v1::Task task;
    if (stopped_) {
      task.set_kind(v1::Task::STOP);
      return task;
    }
    if (waits_[group] > 0) {
      --waits_[group];
      task.set_kind(v1::Task::WAIT);
      return task;
    }
    task.set_kind(v1::Task::TRAIN);
    task.add_group_versions(versions_[group]);
    granted_[group] = true;
    granted_versions_[group] = versions_[group];
    return task;
  }
  absl::StatusOr<uint64_t> PullGroup(uint64_t, uint32_t group, uint64_t min_group_version,
                                     const v1::ModelSpec&, absl::Span<const uint32_t> layer_groups,
                                     std::vector<std::vector<float>>* layers,
                                     uint64_t* bytes) override {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(layer_groups.size(), groups_);
    // The pull asks for at least the version the StartGroup answer granted.
    EXPECT_EQ(min_group_version, granted_versions_[group]) << "group " << group;
    pull_versions_.push_back(min_group_version);
    layers->resize(groups_);
    (*layers)[group] = params_[group];
    *bytes += kElements * sizeof(float);
    if (clock_ != nullptr) clock_->Advance(transfer_);
    return versions_[group];
  }
  absl::StatusOr<v1::PushReply> PushGroup(const v1::PushHeader& header, const v1::ModelSpec&,
                                          absl::Span<const uint32_t>,
                                          const std::vector<std::vector<float>>& layers,
                                          const std::vector<v1::Codec>&, const BlockSizes&,
                                          std::vector<std::vector<float>>*,
                                          uint64_t* bytes) override {
    absl::MutexLock lock(&mu_);
    pushes_.push_back({header, layers});
    if (clock_ != nullptr) clock_->Advance(transfer_);
    const uint32_t g = header.group();
    std::deque<absl::Status>& errors =
        !header.task_continues() && !end_errors_.empty() ? end_errors_ : push_errors_;
    if (!errors.empty()) {
      absl::Status error = errors.front();
      errors.pop_front();
      granted_[g] = false;
      return error;
    }
    if (!granted_[g] || header.base_version() != versions_[g]) {
      return absl::FailedPreconditionError("group not taken, or another version");
    }
    for (size_t l = 0; l < layers.size(); ++l) {
      if (l != g) {
        EXPECT_TRUE(layers[l].empty()) << "layer " << l << " in a push of group " << g;
        continue;
      }
      for (size_t i = 0; i < kElements; ++i) params_[g][i] -= layers[l][i];
    }
    granted_[g] = false;
    ++versions_[g];
    *bytes += kElements * sizeof(float);
    v1::PushReply reply;
    reply.set_applied(true);
    reply.set_group_version(versions_[g]);
    return reply;
  }

  std::vector<PushCall> pushes() {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }
  std::vector<uint32_t> starts() {
    absl::MutexLock lock(&mu_);
    return starts_;
  }
  // The min_group_version of every PullGroup, in order.
  std::vector<uint64_t> pull_versions() {
    absl::MutexLock lock(&mu_);
    return pull_versions_;
  }
  std::vector<float> params(uint32_t group) {
    absl::MutexLock lock(&mu_);
    return params_[group];
  }
  int leaves() {
    absl::MutexLock lock(&mu_);
    return leaves_;
  }
  // Every RequestTask: (ahead, given_up_task_id).
  std::vector<std::pair<bool, uint64_t>> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  const uint32_t groups_;
  v1::PartialSyncConfig partial_sync_;
  absl::Mutex mu_;
  std::vector<std::vector<float>> params_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> versions_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, bool> granted_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, uint64_t> granted_versions_ ABSL_GUARDED_BY(mu_);  // last TRAIN answers
  std::map<uint32_t, int> waits_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::Task> tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> push_errors_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> end_errors_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<bool, uint64_t>> requests_ ABSL_GUARDED_BY(mu_);
  std::vector<PushCall> pushes_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> starts_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> pull_versions_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int leaves_ ABSL_GUARDED_BY(mu_) = 0;
  FakeClock* clock_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Duration transfer_ ABSL_GUARDED_BY(mu_);
};

// Each step subtracts 1 from every parameter. Records each Train call and the parameters it
// started from; `stop_after` total steps sets *stop (a stop request).
class StepTrainer final : public TrainerInterface {
 public:
  struct Call {
    TrainRequest request;
    std::vector<std::vector<float>> start;
  };
  absl::Status SetParameters(const std::vector<std::vector<float>>& layers) override {
    params_ = layers;
    ++set_parameters_calls;
    return absl::OkStatus();
  }
  // Layer-wise access only with `layerwise` (else the whole-model fallback is used).
  absl::Status GetLayers(absl::Span<const uint32_t> ids,
                         std::vector<std::vector<float>>* layers) const override {
    if (!layerwise) return absl::UnimplementedError("whole model only");
    for (uint32_t l : ids) (*layers)[l] = params_[l];
    return absl::OkStatus();
  }
  absl::Status SetLayers(absl::Span<const uint32_t> ids,
                         const std::vector<std::vector<float>>& layers) override {
    if (!layerwise) return absl::UnimplementedError("whole model only");
    for (uint32_t l : ids) params_[l] = layers[l];
    ++set_layers_calls;
    return absl::OkStatus();
  }
  absl::StatusOr<TrainStats> Train(const TrainRequest& request) override {
    calls.push_back({request, params_});
    TrainStats stats;
    for (uint32_t i = 0; i < request.steps; ++i) {
      if (request.interrupt != nullptr && request.interrupt->load()) break;
      for (auto& layer : params_) {
        for (float& p : layer) p -= 1;
      }
      ++stats.steps;
      if (clock != nullptr) clock->Advance(absl::Seconds(1));
      if (++steps_ == stop_after && stop != nullptr) stop->store(true);
    }
    stats.tokens = stats.steps * 10;
    stats.mean_loss = 2.0;
    stats.compute_seconds = stats.steps;
    return stats;
  }
  absl::Status PseudoGradient(const std::vector<std::vector<float>>& base,
                              std::vector<std::vector<float>>* out) const override {
    out->assign(params_.size(), {});
    for (size_t l = 0; l < params_.size(); ++l) {
      for (size_t i = 0; i < params_[l].size(); ++i) {
        (*out)[l].push_back(base[l][i] - params_[l][i]);
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<double> Evaluate(const EvalRequest&) override { return 1.0; }

  const std::vector<std::vector<float>>& params() const { return params_; }

  std::vector<Call> calls;
  bool layerwise = false;
  int set_parameters_calls = 0;
  int set_layers_calls = 0;
  uint64_t stop_after = 0;
  std::atomic<bool>* stop = nullptr;
  FakeClock* clock = nullptr;  // advanced 1 s per step when set

 private:
  std::vector<std::vector<float>> params_;
  uint64_t steps_ = 0;
};

v1::Task TrainTask(uint64_t id, uint32_t steps, uint64_t lr_step = 100, uint64_t seed = 7) {
  v1::Task task;
  task.set_kind(v1::Task::TRAIN);
  task.set_task_id(id);
  task.set_local_steps(steps);
  task.set_lr_step(lr_step);
  task.set_seed(seed);
  task.set_shard_name("s0");
  task.set_shard_file("s0.tok");
  return task;
}

class StreamingRoundsTest : public ::testing::Test {
 protected:
  // A session joined to a server of `groups` groups, and the rounds over it.
  void Start(uint32_t groups, v1::PartialSyncConfig config = {}) {
    rounds_.reset();
    server_ = std::make_unique<GroupServer>(groups, config);
    env_.server = server_.get();
    env_.clock = &clock_;
    env_.sleep = [this](absl::Duration d) { clock_.Advance(d); };
    env_.stop = &stop_;
    session_ = std::make_unique<ServerSession>(options_, env_, "w", 0, 1);
    ASSERT_THAT(session_->Adopt(server_->JoinReply()), IsOk());
    trainer_.stop = &stop_;
    auto rounds = StreamingRounds::Create({.session = session_.get(),
                                           .trainer = &trainer_,
                                           .clock = &clock_,
                                           .stop = &stop_,
                                           .slowdown = 1.0});
    ASSERT_THAT(rounds, IsOk());
    rounds_ = *std::move(rounds);
  }

  AgentOptions options_;
  AgentEnv env_;
  FakeClock clock_;
  std::atomic<bool> stop_{false};
  InMemoryTokenSource data_{std::vector<uint32_t>(100, 1), 8};
  StepTrainer trainer_;
  std::unique_ptr<GroupServer> server_;
  std::unique_ptr<ServerSession> session_;
  std::unique_ptr<StreamingRounds> rounds_;
};

TEST_F(StreamingRoundsTest, StridedTasksPushEachGroupAfterItsStepAndMergeTheGlobalValues) {
  Start(4);
  // Strided, K = 4, H = 8: groups 0..3 after steps 1, 3, 5, 7.
  absl::StatusOr<StreamingTask> first = rounds_->Run(TrainTask(11, 8), &data_);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->ended);
  EXPECT_EQ(first->stats.steps, 8u);
  EXPECT_EQ(first->stats.tokens, 80u);
  // Cold start: every group taken once, in order; then each taken again after its push, and
  // pulled at least at the version granted: 0, then 1 after its push.
  EXPECT_THAT(server_->starts(), ElementsAre(0, 1, 2, 3, 0, 1, 2, 3));
  EXPECT_THAT(server_->pull_versions(), ElementsAre(0, 0, 0, 0, 1, 1, 1, 1));
  std::vector<GroupServer::PushCall> pushes = server_->pushes();
  ASSERT_EQ(pushes.size(), 4u);
  for (uint32_t g = 0; g < 4; ++g) {
    const v1::PushHeader& h = pushes[g].header;
    EXPECT_EQ(h.group(), g);
    EXPECT_EQ(h.task_id(), 11u);
    EXPECT_EQ(h.base_version(), 0u);
    EXPECT_EQ(h.task_continues(), g < 3) << g;
    EXPECT_EQ(h.want_next_task(), g == 3) << g;
    EXPECT_EQ(h.steps_done(), 2 * (g + 1)) << g;  // the task's steps so far
    // g = global - local after 2 (g + 1) steps; the other layers are not sent.
    EXPECT_THAT(pushes[g].layers[g], Each(2.0f * (g + 1))) << g;
  }
  // Segments of 2 steps at LR positions 100, 102, ..., each with its own seed.
  ASSERT_EQ(trainer_.calls.size(), 4u);
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_EQ(trainer_.calls[s].request.steps, 2u);
    EXPECT_EQ(trainer_.calls[s].request.lr_step, 100 + 2 * s);
    for (size_t t = 0; t < s; ++t) {
      EXPECT_NE(trainer_.calls[s].request.seed, trainer_.calls[t].request.seed);
    }
  }
  // Alpha 0 and the server's theta -= g: the merged values are the worker's own.
  for (uint32_t g = 0; g < 4; ++g) {
    EXPECT_THAT(server_->params(g), Each(kStart - 2.0f * (g + 1)));
  }
  for (uint32_t g = 0; g < 4; ++g) EXPECT_THAT(trainer_.params()[g], Each(kStart - 8.0f));

  // The second task needs no cold start: group 0 goes against version 1, its g covers the
  // steps since its merge.
  ASSERT_THAT(rounds_->Run(TrainTask(12, 8), &data_), IsOk());
  pushes = server_->pushes();
  ASSERT_EQ(pushes.size(), 8u);
  EXPECT_EQ(pushes[4].header.group(), 0u);
  EXPECT_EQ(pushes[4].header.base_version(), 1u);
  EXPECT_THAT(pushes[4].layers[0], Each(8.0f));  // steps 2..9 since its merge
  EXPECT_THAT(server_->starts(), ::testing::SizeIs(12));
}

// A trainer with layer-wise access gets only each group's layers at its push and merge, and
// ends exactly where the whole-model path ends.
TEST_F(StreamingRoundsTest, LayerWiseTrainersMoveOnlyTheGroupsLayers) {
  v1::PartialSyncConfig config;
  config.set_merge_delay_steps(1);
  config.set_mixing_alpha(0.5);
  std::vector<std::vector<std::vector<float>>> pushed[2];
  std::vector<std::vector<float>> final_params[2];
  for (int layerwise = 0; layerwise < 2; ++layerwise) {
    trainer_ = StepTrainer();
    trainer_.layerwise = layerwise == 1;
    Start(4, config);
    ASSERT_THAT(rounds_->Run(TrainTask(1, 8), &data_), IsOk());
    ASSERT_THAT(rounds_->Run(TrainTask(2, 8), &data_), IsOk());
    for (const GroupServer::PushCall& p : server_->pushes()) pushed[layerwise].push_back(p.layers);
    final_params[layerwise] = trainer_.params();
    if (layerwise == 1) {
      // 8 pushes, each merged one step later but the last (still pending).
      EXPECT_EQ(trainer_.set_parameters_calls, 1) << "the cold start only";
      EXPECT_EQ(trainer_.set_layers_calls, 7);
    } else {
      EXPECT_EQ(trainer_.set_parameters_calls, 8);
    }
  }
  EXPECT_EQ(pushed[1], pushed[0]);
  EXPECT_EQ(final_params[1], final_params[0]);
}

TEST_F(StreamingRoundsTest, MergeDelayDefersTheMergeAndMixesWithAlpha) {
  v1::PartialSyncConfig config;
  config.set_merge_delay_steps(1);
  config.set_mixing_alpha(0.5);
  Start(2, config);
  // K = 2, H = 4: group 0 after step 1, group 1 after step 3; group 0 merged after step 2.
  ASSERT_THAT(rounds_->Run(TrainTask(1, 4), &data_), IsOk());
  ASSERT_EQ(trainer_.calls.size(), 3u);
  EXPECT_EQ(trainer_.calls[0].request.steps, 2u);
  EXPECT_EQ(trainer_.calls[1].request.steps, 1u);
  EXPECT_EQ(trainer_.calls[2].request.steps, 1u);
  // Pushed g0 = 2 at local 3: the server's group 0 becomes 3. After one more step the local 2
  // is mixed: 0.5 * 2 + 0.5 * 3 = 2.5.
  EXPECT_THAT(trainer_.calls[2].start[0], Each(2.5f));
  EXPECT_THAT(trainer_.calls[2].start[1], Each(2.0f));
  const std::vector<GroupServer::PushCall> pushes = server_->pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_THAT(pushes[1].layers[1], Each(4.0f));
  EXPECT_FALSE(pushes[1].header.task_continues());
  // Group 1's merge is due one step into the next task: it carries over.
  EXPECT_THAT(trainer_.params()[1], Each(1.0f));
  ASSERT_THAT(rounds_->Run(TrainTask(2, 4), &data_), IsOk());
  // Its first segment is that one step; the merge mixes local 0 with global 1: 0.5.
  EXPECT_EQ(trainer_.calls[3].request.steps, 1u);
  EXPECT_THAT(trainer_.calls[4].start[1], Each(0.5f));
}

TEST_F(StreamingRoundsTest, RefusedPushTakesTheGroupAgainAndReplacesIt) {
  Start(2);
  server_->AddPushError(absl::FailedPreconditionError("too stale (max_staleness)"));
  ASSERT_THAT(rounds_->Run(TrainTask(1, 4), &data_), IsOk());
  // Group 0's push was refused: taken again at the server's unchanged values, which replace the
  // local ones (local 3 becomes 5), so the next segment starts there.
  EXPECT_THAT(server_->params(0), Each(kStart));
  EXPECT_THAT(trainer_.calls[1].start[0], Each(kStart));
  EXPECT_THAT(server_->starts(), ElementsAre(0, 1, 0, 1));
  // The task went on: group 1 pushed and ended it.
  const std::vector<GroupServer::PushCall> pushes = server_->pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_FALSE(pushes[1].header.task_continues());
}

// Overlap: Run leaves the task's last push in flight (the next task is taken ahead meanwhile)
// and AwaitEnd answers it; a refused one is given up on the background thread first.
TEST_F(StreamingRoundsTest, AnEndLeftInFlightIsAnsweredLaterAndARefusedOneGivenUp) {
  Start(2);
  absl::StatusOr<StreamingTask> first = rounds_->Run(TrainTask(1, 4), &data_, /*await_end=*/false);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->end_in_flight);
  EXPECT_FALSE(first->ended);
  RoundCosts costs;
  absl::StatusOr<v1::PushReply> reply = rounds_->AwaitEnd(&costs);
  ASSERT_THAT(reply, IsOk());
  EXPECT_EQ(reply->group_version(), 1u);  // group 1's first push
  // Both pushes' bytes are counted once: at a merge during Run, or here.
  EXPECT_EQ(first->costs.pushed_bytes + costs.pushed_bytes, 2 * kElements * sizeof(float));
  EXPECT_THAT(rounds_->AwaitEnd(&costs),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no task's last push")));
  const std::vector<GroupServer::PushCall> pushes = server_->pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_FALSE(pushes[1].header.task_continues());
  EXPECT_FALSE(pushes[1].header.want_next_task()) << "the next task is taken ahead instead";

  // Task 2's last push is refused: the task is given up (RequestTask naming it) before AwaitEnd
  // returns the refusal.
  server_->AddEndError(absl::FailedPreconditionError("too stale"));
  absl::StatusOr<StreamingTask> second = rounds_->Run(TrainTask(2, 4), &data_, false);
  ASSERT_THAT(second, IsOk());
  EXPECT_THAT(rounds_->AwaitEnd(&costs),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("too stale")));
  EXPECT_THAT(server_->requests(), ElementsAre(std::make_pair(false, uint64_t{2})));
  // Awaited (the default), a refused last push is Run's error, and nothing is given up here.
  server_->AddEndError(absl::FailedPreconditionError("too stale"));
  EXPECT_THAT(rounds_->Run(TrainTask(3, 4), &data_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("too stale")));
  EXPECT_EQ(server_->requests().size(), 1u);
}

TEST_F(StreamingRoundsTest, UnknownWorkerEndsTheTaskWithNotFound) {
  Start(2);
  server_->AddPushError(absl::NotFoundError("unknown worker 1"));
  EXPECT_THAT(rounds_->Run(TrainTask(1, 4), &data_),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(StreamingRoundsTest, WaitAnswersHoldTheMergeUntilTheGroupIsGranted) {
  Start(2);
  ASSERT_THAT(rounds_->Run(TrainTask(1, 4), &data_), IsOk());
  server_->AddWaits(0, 3);  // group 0's next sync round is not complete yet
  ASSERT_THAT(rounds_->Run(TrainTask(2, 4), &data_), IsOk());
  EXPECT_THAT(server_->starts(), ElementsAre(0, 1, 0, 1, 0, 0, 0, 0, 1));
  EXPECT_EQ(server_->pushes().size(), 4u);
}

TEST_F(StreamingRoundsTest, ServerStopWhileTakingEndsTheTask) {
  Start(2);
  ASSERT_THAT(rounds_->Run(TrainTask(1, 4), &data_), IsOk());
  server_->StopTraining();
  absl::StatusOr<StreamingTask> last = rounds_->Run(TrainTask(2, 4), &data_);
  ASSERT_THAT(last, IsOk());
  EXPECT_TRUE(last->server_stopped);
  EXPECT_FALSE(last->ended);
  EXPECT_EQ(server_->pushes().size(), 3u);  // group 0 of the second task, then STOP
}

TEST_F(StreamingRoundsTest, StopRequestPushesTheStepsDoneOfEveryHeldGroup) {
  Start(4);
  trainer_.stop_after = 3;  // during the second segment
  absl::StatusOr<StreamingTask> done = rounds_->Run(TrainTask(1, 8), &data_);
  ASSERT_THAT(done, IsOk());
  EXPECT_TRUE(done->ended);
  EXPECT_EQ(done->stats.steps, 3u);
  const std::vector<GroupServer::PushCall> pushes = server_->pushes();
  // Group 0 after step 1 (merged at once); then every group with the 3 steps done, the last
  // ending the task.
  ASSERT_EQ(pushes.size(), 5u);
  EXPECT_EQ(pushes[1].header.group(), 0u);
  EXPECT_THAT(pushes[1].layers[0], Each(1.0f));  // the one step since its merge
  EXPECT_THAT(pushes[2].layers[1], Each(3.0f));
  EXPECT_EQ(pushes[4].header.group(), 3u);
  EXPECT_FALSE(pushes[4].header.task_continues());
  EXPECT_TRUE(pushes[3].header.task_continues());
  EXPECT_EQ(pushes[4].header.steps_done(), 3u);
}

TEST_F(StreamingRoundsTest, SchedulesEndTheTaskWithAPush) {
  v1::PartialSyncConfig config;
  config.set_schedule(v1::SYNC_SCHEDULE_EQUAL_NUMBER);
  Start(2, config);
  // ENP with K = 2, H = 4 syncs group 1 after step 0 and group 0 after step 1; rotated, the
  // same sets come after steps 2 and 3.
  absl::StatusOr<SyncSchedule> schedule = rounds_->ScheduleFor(4);
  ASSERT_THAT(schedule, IsOk());
  EXPECT_EQ(schedule->syncs, (std::vector<std::vector<uint32_t>>{{}, {}, {1}, {0}}));
  ASSERT_THAT(rounds_->Run(TrainTask(1, 4), &data_), IsOk());
  const std::vector<GroupServer::PushCall> pushes = server_->pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.group(), 1u);
  EXPECT_EQ(pushes[1].header.group(), 0u);
  EXPECT_EQ(pushes[1].header.steps_done(), 4u);
  // DreamDDP before any measurement: strided.
  config.set_schedule(v1::SYNC_SCHEDULE_DREAMDDP);
  Start(2, config);
  schedule = rounds_->ScheduleFor(4);
  ASSERT_THAT(schedule, IsOk());
  EXPECT_EQ(schedule->syncs, StridedSchedule(2, 4)->syncs);
}

// The non-empty steps' sets in order (a rotation keeps them).
std::vector<std::vector<uint32_t>> SyncSets(const SyncSchedule& schedule) {
  std::vector<std::vector<uint32_t>> sets;
  for (const std::vector<uint32_t>& set : schedule.syncs) {
    if (!set.empty()) sets.push_back(set);
  }
  return sets;
}

TEST_F(StreamingRoundsTest, DreamDdpPlansFromTheMeasuredStepTimeAndLinkRate) {
  v1::PartialSyncConfig config;
  config.set_schedule(v1::SYNC_SCHEDULE_DREAMDDP);
  Start(2, config);
  trainer_.clock = &clock_;
  server_->SetTransferTime(&clock_, absl::Milliseconds(500));
  ASSERT_THAT(rounds_->Run(TrainTask(1, 4), &data_), IsOk());
  // Measured: 1 s a step; six transfers (two cold pulls, two pushes, two pulls) of 8 bytes in
  // 0.5 s each: 16 bytes/s; start_group answered at once: no round trip.
  absl::StatusOr<UnitCosts> costs =
      UnitCostsFromProfile(1.0, std::vector<uint64_t>{kElements, kElements}, 4.0, {16.0, 0.0});
  ASSERT_THAT(costs, IsOk());
  absl::StatusOr<SyncSchedule> expected = DreamDdpSchedule(*costs, 4, false);
  ASSERT_THAT(expected, IsOk());
  absl::StatusOr<SyncSchedule> schedule = rounds_->ScheduleFor(4);
  ASSERT_THAT(schedule, IsOk());
  EXPECT_EQ(SyncSets(*schedule), SyncSets(*expected))
      << schedule->ToString() << " vs " << expected->ToString();
  EXPECT_FALSE(schedule->syncs.back().empty());
  ASSERT_THAT(ValidateSchedule(*schedule), IsOk());
}

TEST_F(StreamingRoundsTest, TimeBudgetPlansTheStepsThatFitAtTheMeasuredSpeed) {
  Start(2);
  v1::Task task = TrainTask(1, 50);
  task.set_time_budget_seconds(10);
  // Nothing measured: a short task of K steps.
  EXPECT_EQ(rounds_->PlannedSteps(task), 2u);
  EXPECT_EQ(rounds_->PlannedSteps(TrainTask(1, 50)), 50u);
  // 1 s a step: the 10 s budget holds 10 steps.
  trainer_.clock = &clock_;
  ASSERT_THAT(rounds_->Run(TrainTask(2, 4), &data_), IsOk());
  EXPECT_EQ(rounds_->PlannedSteps(task), 10u);
  task.set_local_steps(6);  // the cap
  EXPECT_EQ(rounds_->PlannedSteps(task), 6u);
}

// DreamDDP's transfer cost counts each layer at its codec; a low-rank layer at its factors.
TEST(EstimatedPushBytesTest, CountsLowRankLayersAtTheirFactorSize) {
  v1::LayerSpec layer;
  layer.set_name("blocks.0");
  auto add = [&](const char* name, std::vector<int64_t> shape) {
    v1::TensorSpec* t = layer.add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
  };
  add("w", {64, 256});  // 16384 values; rank 8 factors (64 + 256) * 8 = 2560
  add("b", {256});      // 1-D: whole, at the fallback codec
  add("e", {3, 4, 5});  // 3 x 20: rank 3 factors (69) are not fewer than 60 values: whole
  layer.set_num_elements(16384 + 256 + 60);
  auto with = [](const std::string& text) {
    v1::TransportConfig transport;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &transport)) << text;
    return transport;
  };
  EXPECT_EQ(EstimatedPushBytes(layer, with("")), 16700.0 * 4);
  EXPECT_EQ(EstimatedPushBytes(layer, with("codec: CODEC_BF16")), 16700.0 * 2);
  EXPECT_EQ(EstimatedPushBytes(layer, with("codec: CODEC_BF16 layer_codecs { layer: 'blocks.0' "
                                           "codec: CODEC_INT4_BLOCKWISE }")),
            16700.0 / 2);
  // Another layer's entry does not apply.
  EXPECT_EQ(EstimatedPushBytes(layer, with("layer_codecs { layer: 'head' codec: CODEC_BF16 }")),
            16700.0 * 4);
  const std::string low_rank = "layer_codecs { layer: 'blocks.0' codec: CODEC_LOWRANK rank: ";
  EXPECT_EQ(EstimatedPushBytes(layer, with(low_rank + "8 }")), 2560.0 * 4 + 256 * 4 + 60 * 4);
  EXPECT_EQ(EstimatedPushBytes(layer, with(low_rank + "8 factor_codec: CODEC_INT4_BLOCKWISE }")),
            2560.0 / 2 + 256 * 4 + 60 * 4);
  EXPECT_EQ(EstimatedPushBytes(layer, with(low_rank + "8 factor_codec: CODEC_BF16 }")),
            2560.0 * 2 + 256 * 2 + 60 * 2);
  // Rank 100 is clamped to 64, where (64 + 256) * 64 factors outnumber the 16384 values.
  EXPECT_EQ(EstimatedPushBytes(layer, with(low_rank + "100 }")), 16700.0 * 4);
}

// The agent runs streaming rounds when the join reply has layer groups.
TEST(AgentStreamingTest, JoinWithLayerGroupsRunsStreamingRounds) {
  GroupServer server(2, {});
  server.AddTask(TrainTask(5, 4));
  FakeClock clock;
  FakeSleeper sleeper(clock);
  NullMetrics metrics;
  std::atomic<bool> stop{false};
  InMemoryTokenSource data(std::vector<uint32_t>(100, 1), 8);
  StepTrainer* trainer = nullptr;
  AgentEnv env;
  env.server = &server;
  env.metrics = &metrics;
  env.clock = &clock;
  env.sleep = [&](absl::Duration d) { sleeper.Advance(d); };
  env.sleeper = &sleeper;
  env.stop = &stop;
  env.make_trainer =
      [&](const v1::JoinReply&) -> absl::StatusOr<std::unique_ptr<TrainerInterface>> {
    auto made = std::make_unique<StepTrainer>();
    trainer = made.get();
    return made;
  };
  env.open_shard = [&](const std::string&) -> absl::StatusOr<const TokenSource*> { return &data; };
  AgentOptions options;
  options.name = "streaming";
  Agent agent(options, std::move(env));
  ASSERT_THAT(agent.Run(), IsOk());
  const std::vector<GroupServer::PushCall> pushes = server.pushes();
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].header.group(), 0u);
  EXPECT_EQ(pushes[1].header.group(), 1u);
  EXPECT_EQ(pushes[1].header.task_id(), 5u);
  EXPECT_FALSE(pushes[1].header.task_continues());
  ASSERT_NE(trainer, nullptr);
  EXPECT_EQ(trainer->calls.size(), 2u);
  EXPECT_EQ(server.leaves(), 1);
}

}  // namespace
}  // namespace aloe::worker
