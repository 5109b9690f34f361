// ServerCore with layer groups (ServerConfig.partial_sync): each group has its own version,
// aggregation (sync round or grace window), outer optimizer state and staleness; tasks are not
// gated; StartGroup holds a worker where its group's aggregation says; checkpoints resume
// exactly. Golden numbers are computed here in double with plain loops.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/config.h"
#include "common/layer_groups.h"
#include "common/status_matchers.h"
#include "server/core/server_core.h"
#include "tests/testing/server_core_calls.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

v1::ServerConfig GroupConfig(uint32_t groups, v1::AggregationMode mode) {
  v1::ServerConfig config;
  config.mutable_model()->set_vocab_size(16);
  config.mutable_model()->set_seq_len(8);
  config.mutable_model()->set_d_model(8);
  config.mutable_model()->set_num_layers(2);
  config.mutable_model()->set_num_heads(2);
  config.set_corpus_dir("unused");
  config.set_local_steps(4);
  config.mutable_aggregation()->set_mode(mode);
  config.mutable_aggregation()->set_min_workers(2);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_SGD);
  config.mutable_outer_optimizer()->set_lr(0.5f);
  config.mutable_partial_sync()->set_groups(groups);
  FillServerDefaults(&config);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

// RequestTask with start_group.
v1::Task TakeGroup(ServerCore& core, uint64_t worker, uint32_t group) {
  return ::aloe::testing::RequestTaskOf(core, worker, group);
}

class LayerGroupCoreTest : public ::testing::Test {
 protected:
  void Make(const v1::ServerConfig& config) {
    auto core = ServerCore::Create(config, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                   "heldout.tok", clock_, executor_, metrics_);
    ASSERT_THAT(core, IsOk());
    core_ = *std::move(core);
  }

  uint64_t Join() { return ::aloe::testing::JoinTrainer(*core_); }
  v1::Task Request(uint64_t worker) { return ::aloe::testing::RequestTaskOf(*core_, worker); }

  v1::Task StartGroup(uint64_t worker, uint32_t group) { return TakeGroup(*core_, worker, group); }

  // A push of `group` whose every element is `value`, based on group version `base`.
  PendingUpdate GroupUpdate(uint64_t worker, const v1::Task& task, uint32_t group, uint64_t base,
                            float value, bool task_continues = true) {
    PendingUpdate u;
    u.worker_id = worker;
    u.task_id = task.task_id();
    u.base_version = base;
    u.group = group;
    u.task_continues = task_continues;
    u.steps_done = task.local_steps();
    u.tokens_learned = 100;
    u.compute_seconds = 1.0;
    const auto& groups = core_->layer_groups();
    for (const auto& layer : core_->spec().layers()) {
      u.layers.emplace_back(groups[layer.id()] == group ? layer.num_elements() : 0, value);
    }
    return u;
  }

  std::vector<std::vector<float>> Params() const {
    std::vector<std::vector<float>> out;
    for (const auto& layer : core_->Snapshot().layers) out.push_back(*layer);
    return out;
  }

  // Expects every parameter of `group` to be its value in `start` minus shift, the others
  // unchanged.
  void ExpectGroupShiftedBy(const std::vector<std::vector<float>>& start, uint32_t group,
                            double shift) const {
    const auto now = Params();
    for (size_t l = 0; l < now.size(); ++l) {
      const double expected = core_->layer_groups()[l] == group ? shift : 0.0;
      for (size_t i = 0; i < now[l].size(); ++i) {
        ASSERT_NEAR(now[l][i], start[l][i] - expected, 1e-5) << "layer " << l << " element " << i;
      }
    }
  }

  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
  std::unique_ptr<ServerCore> core_;
};

TEST(LayerGroupsTest, SplitsContiguouslyBalancedByElementsAndFillsEveryGroup) {
  v1::ModelSpec spec;
  for (uint64_t n : {100, 10, 10, 10, 10, 60}) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(spec.layers_size() - 1);
    layer->set_num_elements(n);
  }
  // Total 200: shares of 100 each for K = 2; the big first layer fills group 0 alone.
  EXPECT_EQ(*AssignLayerGroups(spec, 2), (std::vector<uint32_t>{0, 1, 1, 1, 1, 1}));
  // K = 4 (shares of 50): the midpoints 50, 105, 115, 125, 135, 170 move on from a group once
  // past its share's end (100 for group 1, 150 for group 2), one group per layer.
  EXPECT_EQ(*AssignLayerGroups(spec, 4), (std::vector<uint32_t>{0, 1, 2, 2, 2, 3}));
  // As many groups as layers: one each.
  EXPECT_EQ(*AssignLayerGroups(spec, 6), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(*AssignLayerGroups(spec, 1), (std::vector<uint32_t>(6, 0)));
  EXPECT_THAT(AssignLayerGroups(spec, 7),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("partial_sync.groups")));
  EXPECT_THAT(AssignLayerGroups(spec, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 0")));
  EXPECT_EQ(LayersOfGroups({0, 1, 1, 2}), (std::vector<std::vector<uint32_t>>{{0}, {1, 2}, {3}}));
}

TEST(LayerGroupConfigTest, RefusesWhatLayerGroupsCannotDo) {
  // Layer-sharded: a sync round may wait with an update of every group per trainer staged.
  v1::ServerConfig config = GroupConfig(4, v1::AGGREGATION_SYNC);
  config.set_shard_processes(2);
  config.set_max_staged_updates(8);  // 2 trainers x 4 groups
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  config.set_max_staged_updates(7);
  EXPECT_THAT(ValidateServerConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("min_workers (2) x partial_sync.groups (4) exceeds "
                                 "max_staged_updates (7)")));
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  config = GroupConfig(2, v1::AGGREGATION_SYNC);
  config.mutable_partial_sync()->set_fill_bubbles(true);
  EXPECT_THAT(ValidateServerConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DREAMDDP")));
  config.mutable_partial_sync()->set_schedule(v1::SYNC_SCHEDULE_DREAMDDP);
  EXPECT_THAT(ValidateServerConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ASYNC")));
  config = GroupConfig(2, v1::AGGREGATION_SYNC);
  config.mutable_partial_sync()->set_mixing_alpha(1.0);
  EXPECT_THAT(ValidateServerConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mixing_alpha")));
}

TEST_F(LayerGroupCoreTest, MoreGroupsThanLayersIsRefusedAtCreate) {
  v1::ServerConfig config = GroupConfig(2, v1::AGGREGATION_SYNC);
  config.mutable_partial_sync()->set_groups(1000);
  auto core = ServerCore::Create(config, {{"a", "a.tok", 1000}}, "heldout.tok", clock_, executor_,
                                 metrics_);
  EXPECT_THAT(core, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer count")));
}

TEST_F(LayerGroupCoreTest, SyncGroupsRoundAndVersionSeparately) {
  Make(GroupConfig(2, v1::AGGREGATION_SYNC));
  ASSERT_EQ(core_->num_layer_groups(), 2u);
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_EQ(ta.kind(), v1::Task::TRAIN);
  ASSERT_EQ(ta.group_versions_size(), 2);
  const auto start = Params();

  // Pushing a group before taking it is refused and changes nothing.
  EXPECT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 0, 0, 1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("without having taken")));
  for (uint32_t g = 0; g < 2; ++g) {
    EXPECT_EQ(StartGroup(a, g).kind(), v1::Task::TRAIN);
    const v1::Task granted = StartGroup(b, g);
    ASSERT_EQ(granted.kind(), v1::Task::TRAIN);
    EXPECT_EQ(granted.group_versions(0), 0u);
  }
  // Bad pushes: another group's layers, a group out of range, a base the worker did not take.
  PendingUpdate wrong = GroupUpdate(a, ta, 0, 0, 1.0f);
  std::swap(wrong.layers.front(), wrong.layers.back());
  EXPECT_THAT(core_->SubmitUpdate(std::move(wrong)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("elements")));
  EXPECT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 5, 0, 1.0f)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer group 5")));
  EXPECT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 0, 3, 1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("based on version 3")));
  EXPECT_EQ(Params(), start);

  // Group 0's round: a's push waits for b's; then only group 0 steps (SGD lr 0.5 on the mean).
  auto first = core_->SubmitUpdate(GroupUpdate(a, ta, 0, 0, 1.0f));
  ASSERT_THAT(first, IsOk());
  EXPECT_FALSE(first->applied());
  EXPECT_EQ(StartGroup(a, 0).kind(), v1::Task::WAIT);  // its round is still open
  auto second = core_->SubmitUpdate(GroupUpdate(b, tb, 0, 0, 3.0f));
  ASSERT_THAT(second, IsOk());
  EXPECT_TRUE(second->applied());
  EXPECT_EQ(second->group_version(), 1u);
  ExpectGroupShiftedBy(start, 0, 0.5 * 2.0);
  EXPECT_EQ(core_->group_version(0), 1u);
  EXPECT_EQ(core_->group_version(1), 0u);
  EXPECT_EQ(core_->version(), 1u);
  const v1::Task again = StartGroup(a, 0);
  ASSERT_EQ(again.kind(), v1::Task::TRAIN);
  EXPECT_EQ(again.group_versions(0), 1u);
  EXPECT_EQ(StartGroup(a, 0).group_versions(0), 1u);  // asked again: the same answer

  // Group 1 ends both tasks: the tasks' tokens count once each, with their last push.
  const uint64_t tokens_before =
      core_->sampler().tokens_learned(0) + core_->sampler().tokens_learned(1);
  ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 1, 0, 2.0f, /*task_continues=*/false)),
              IsOk());
  auto last = core_->SubmitUpdate(GroupUpdate(b, tb, 1, 0, 2.0f, /*task_continues=*/false));
  ASSERT_THAT(last, IsOk());
  EXPECT_TRUE(last->applied());
  EXPECT_EQ(core_->group_version(1), 1u);
  EXPECT_EQ(core_->version(), 2u);
  EXPECT_EQ(core_->sampler().tokens_learned(0) + core_->sampler().tokens_learned(1),
            tokens_before + 200);
  // New tasks come at once (no aggregation gates them); a pushed task is not pushed again.
  EXPECT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 1, 1, 2.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no open training task")));
  const v1::Task next = Request(a);
  EXPECT_EQ(next.kind(), v1::Task::TRAIN);
  EXPECT_NE(next.task_id(), ta.task_id());
  EXPECT_EQ(next.group_versions(0), 1u);
  EXPECT_EQ(next.group_versions(1), 1u);
  EXPECT_EQ(metrics_.Value("aloe_layer_group_version", {"1"}), 1.0);
  EXPECT_EQ(metrics_.Observations("aloe_layer_group_staleness", {"0"}).size(), 2u);
}

// Delayed Nesterov (paper 002 Alg. 3) per group, in plain double.
struct DelayedNesterov {
  double lr, beta;
  int n;
  double m = 0, d = 0;
  int t = 0;
  double Step(double g) {  // returns the change of theta
    d += g;
    double delta;
    if ((t + 1) % n == 0) {
      m = beta * m + d / n;
      delta = -lr * (beta * m + g / n);
      d = 0;
    } else {
      delta = -lr * (g / n);
    }
    ++t;
    return delta;
  }
};

TEST_F(LayerGroupCoreTest, DelayedNesterovCountsAndStalenessArePerGroup) {
  v1::ServerConfig config = GroupConfig(2, v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_DELAYED_NESTEROV);
  config.mutable_outer_optimizer()->set_lr(0.7f);
  config.mutable_outer_optimizer()->set_momentum(0.9f);
  config.mutable_outer_optimizer()->set_dn_buffer_size(2);
  Make(config);
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  const auto start = Params();
  DelayedNesterov group0{0.7, 0.9, 2}, group1{0.7, 0.9, 2};
  double shift0 = 0, shift1 = 0;

  // a takes group 0 at version 0 and pushes late; b pushes group 0 twice first.
  ASSERT_EQ(StartGroup(a, 0).group_versions(0), 0u);
  for (uint64_t base = 0; base < 2; ++base) {
    ASSERT_EQ(StartGroup(b, 0).group_versions(0), base);
    auto reply = core_->SubmitUpdate(GroupUpdate(b, tb, 0, base, 1.0f));
    ASSERT_THAT(reply, IsOk());
    EXPECT_EQ(reply->staleness(), 0u);
    shift0 -= group0.Step(1.0);
  }
  // b's group 1: the third DN call of the server, the first of group 1's optimizer.
  ASSERT_EQ(StartGroup(b, 1).group_versions(0), 0u);
  ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(b, tb, 1, 0, 2.0f, false)), IsOk());
  shift1 -= group1.Step(2.0);
  // a's group 0 push is two steps of group 0 stale, whatever group 1 did.
  auto stale = core_->SubmitUpdate(GroupUpdate(a, ta, 0, 0, 0.5f));
  ASSERT_THAT(stale, IsOk());
  EXPECT_EQ(stale->staleness(), 2u);
  EXPECT_EQ(stale->group_version(), 3u);
  shift0 -= group0.Step(0.5);
  EXPECT_EQ(core_->version(), 4u);
  const auto now = Params();
  for (size_t l = 0; l < now.size(); ++l) {
    const double shift = core_->layer_groups()[l] == 0 ? shift0 : shift1;
    for (size_t i = 0; i < now[l].size(); ++i) {
      ASSERT_NEAR(now[l][i], start[l][i] - shift, 1e-5) << "layer " << l;
    }
  }
  // Golden values by hand: group 0: 0.35, then m = 1: 0.7 * (0.9 + 0.5) = 0.98, then
  // 0.7 * 0.25 = 0.175; group 1: 0.7 * 1.0 = 0.7.
  EXPECT_NEAR(shift0, 0.35 + 0.98 + 0.175, 1e-9);
  EXPECT_NEAR(shift1, 0.7, 1e-9);
}

TEST_F(LayerGroupCoreTest, TooStaleGroupPushIsDroppedAndTheGroupTakenAgain) {
  v1::ServerConfig config = GroupConfig(2, v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  config.mutable_outer_optimizer()->set_max_staleness(1);
  Make(config);
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  StartGroup(a, 0);
  for (uint64_t base = 0; base < 2; ++base) {
    StartGroup(b, 0);
    ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(b, tb, 0, base, 1.0f)), IsOk());
  }
  const auto before = Params();
  EXPECT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 0, 0, 1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("max_staleness")));
  EXPECT_EQ(Params(), before);
  // The task stays open; the group is taken again at its current version.
  EXPECT_EQ(StartGroup(a, 0).group_versions(0), 2u);
  EXPECT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 0, 2, 1.0f)), IsOk());
}

TEST_F(LayerGroupCoreTest, WholeModelPushesAreRefusedAndTheNextTaskWaitsForTheLastPush) {
  Make(GroupConfig(2, v1::AGGREGATION_SYNC));
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  Request(b);
  StartGroup(a, 0);
  PendingUpdate whole = GroupUpdate(a, ta, 0, 0, 1.0f);
  for (size_t l = 0; l < whole.layers.size(); ++l) {
    whole.layers[l].assign(core_->spec().layers(static_cast<int>(l)).num_elements(), 1.0f);
  }
  EXPECT_THAT(core_->SubmitUpdate(std::move(whole)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("elements")));
  // While the open task's last push is on its way, a plain request gets the open task back and
  // a look-ahead request the next task, which becomes the open one when that push arrives.
  EXPECT_EQ(Request(a).task_id(), ta.task_id());
  v1::TaskRequest ahead;
  ahead.set_worker_id(a);
  ahead.set_ahead(true);
  auto next = core_->RequestTask(ahead);
  ASSERT_THAT(next, IsOk());
  ASSERT_EQ(next->kind(), v1::Task::TRAIN);
  EXPECT_NE(next->task_id(), ta.task_id());
  EXPECT_EQ(next->group_versions_size(), 2);
  ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 0, 0, 1.0f)), IsOk());
  StartGroup(a, 1);
  ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 1, 0, 1.0f, /*task_continues=*/false)),
              IsOk());
  EXPECT_EQ(Request(a).task_id(), next->task_id());
}

TEST_F(LayerGroupCoreTest, WorkerThatLeavesIsNotWaitedForInAnyGroup) {
  Make(GroupConfig(2, v1::AGGREGATION_SYNC));
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  Request(b);
  for (uint32_t g = 0; g < 2; ++g) {
    StartGroup(a, g);
    StartGroup(b, g);
  }
  ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 0, 0, 1.0f)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, 1, 0, 1.0f, false)), IsOk());
  EXPECT_EQ(core_->version(), 0u);
  v1::LeaveRequest leave;
  leave.set_worker_id(b);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  // Both groups' rounds complete with a's pushes alone.
  EXPECT_EQ(core_->group_version(0), 1u);
  EXPECT_EQ(core_->group_version(1), 1u);
  EXPECT_EQ(core_->version(), 2u);
}

TEST_F(LayerGroupCoreTest, AStopAtStartGroupEndsTheTaskSoThatTheWorkerStops) {
  v1::ServerConfig config = GroupConfig(2, v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  config.set_max_versions(2);
  Make(config);
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  Request(b);
  for (uint32_t g = 0; g < 2; ++g) {
    StartGroup(a, g);
    ASSERT_THAT(core_->SubmitUpdate(GroupUpdate(a, ta, g, 0, 1.0f, g == 0)), IsOk());
  }
  ASSERT_EQ(core_->version(), 2u);  // the last version: training is over
  EXPECT_EQ(StartGroup(b, 0).kind(), v1::Task::STOP);
  EXPECT_EQ(Request(b).kind(), v1::Task::STOP);
  EXPECT_EQ(core_->open_tasks(), 0u);
}

TEST_F(LayerGroupCoreTest, FourGroupsResumeExactlyFromACheckpoint) {
  v1::ServerConfig config = GroupConfig(4, v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_DELAYED_NESTEROV);
  config.mutable_outer_optimizer()->set_momentum(0.9f);
  config.mutable_outer_optimizer()->set_dn_buffer_size(3);
  config.mutable_checkpoint()->set_dir("unused");
  config.mutable_checkpoint()->set_every_versions(4);
  Make(config);
  ASSERT_EQ(core_->num_layer_groups(), 4u);
  // One task pushes groups 3, 1, 0, 2 (not in order), values varying with the round.
  auto round = [&](ServerCore& core, uint64_t worker, uint32_t r) {
    v1::TaskRequest request;
    request.set_worker_id(worker);
    auto task = core.RequestTask(request);
    EXPECT_THAT(task, IsOk());
    const uint32_t order[4] = {3, 1, 0, 2};
    for (int k = 0; k < 4; ++k) {
      const uint32_t g = order[k];
      const v1::Task granted = TakeGroup(core, worker, g);
      PendingUpdate u;
      u.worker_id = worker;
      u.task_id = task->task_id();
      u.base_version = granted.group_versions(0);
      u.group = g;
      u.task_continues = k < 3;
      u.steps_done = task->local_steps();
      u.tokens_learned = 10;
      u.compute_seconds = 1;
      for (const auto& layer : core.spec().layers()) {
        std::vector<float> values;
        if (core.layer_groups()[layer.id()] == g) {
          for (uint64_t i = 0; i < layer.num_elements(); ++i) {
            values.push_back(static_cast<float>(((r * 7 + g * 3 + i) % 11) - 5) * 0.01f);
          }
        }
        u.layers.push_back(std::move(values));
      }
      EXPECT_THAT(core.SubmitUpdate(std::move(u)), IsOk());
    }
    return *task;
  };
  const uint64_t a = Join();
  round(*core_, a, 0);  // versions 1..4: the checkpoint falls due at 4
  std::vector<v1::ServerCheckpoint> due = core_->TakeDueCheckpoints();
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].version(), 4u);
  EXPECT_EQ(due[0].group_versions_size(), 4);

  FakeClock clock2;
  RecordingMetrics metrics2;
  auto restored = ServerCore::Create(config, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                     "heldout.tok", clock2, executor_, metrics2);
  ASSERT_THAT(restored, IsOk());
  ASSERT_THAT((*restored)->RestoreCheckpoint(due[0]), IsOk());
  v1::JoinRequest join;
  join.set_name("w");
  auto b = (*restored)->Join(join);
  ASSERT_THAT(b, IsOk());
  for (uint32_t r = 1; r < 4; ++r) {
    const v1::Task t1 = round(*core_, a, r);
    const v1::Task t2 = round(**restored, b->worker_id(), r);
    EXPECT_EQ(t1.task_id(), t2.task_id());
    EXPECT_EQ(t1.shard_name(), t2.shard_name());
    EXPECT_EQ(t1.lr_step(), t2.lr_step());
  }
  auto params = [](const ServerCore& core) {
    std::vector<std::vector<float>> out;
    for (const auto& layer : core.Snapshot().layers) out.push_back(*layer);
    return out;
  };
  EXPECT_EQ(params(*core_), params(**restored));  // bit-identical: DN state per layer restored
  for (uint32_t g = 0; g < 4; ++g) {
    EXPECT_EQ(core_->group_version(g), 4u);
    EXPECT_EQ((*restored)->group_version(g), 4u);
  }
  EXPECT_EQ((*restored)->version(), 16u);

  // A checkpoint of whole-model synchronization is not one of four groups.
  v1::ServerConfig whole = config;
  whole.mutable_partial_sync()->set_groups(1);
  FakeClock clock3;
  RecordingMetrics metrics3;
  auto other = ServerCore::Create(whole, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                  "heldout.tok", clock3, executor_, metrics3);
  ASSERT_THAT(other, IsOk());
  EXPECT_THAT((*other)->RestoreCheckpoint(due[0]),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another model")));
}

}  // namespace
}  // namespace aloe::server
