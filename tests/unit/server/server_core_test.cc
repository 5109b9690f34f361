// ServerCore end to end without a network: membership, sync rounds, task assignment, push
// validation (nothing applied on bad input), evaluation bookkeeping and the stop condition.
#include "server/core/server_core.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "server/core/server_metrics.h"
#include "server/core/shard_assembly.h"
#include "server/core/update_assembler.h"
#include "tests/testing/server_core_calls.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

v1::ServerConfig TinyConfig() { return aloe::testing::TinyServerConfig(); }

class ServerCoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(TinyConfig()); }

  void Make(const v1::ServerConfig& config) {
    auto core = ServerCore::Create(config, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                   "heldout.tok", clock_, executor_, metrics_);
    ASSERT_THAT(core, IsOk());
    core_ = *std::move(core);
  }

  uint64_t Join(v1::Role role = v1::ROLE_TRAINER) {
    v1::JoinRequest request;
    request.set_name("w");
    request.set_role(role);
    auto reply = core_->Join(request);
    EXPECT_THAT(reply, IsOk());
    return reply->worker_id();
  }

  v1::Task Request(uint64_t worker) {
    v1::TaskRequest request;
    request.set_worker_id(worker);
    auto task = core_->RequestTask(request);
    EXPECT_THAT(task, IsOk());
    return *task;
  }

  // TaskRequest.ahead: the task after the worker's open one (overlap).
  v1::Task Ahead(uint64_t worker) {
    v1::TaskRequest request;
    request.set_worker_id(worker);
    request.set_ahead(true);
    auto task = core_->RequestTask(request);
    EXPECT_THAT(task, IsOk());
    return *task;
  }

  // Expects every parameter to be its value in `start` minus `shift`.
  void ExpectShiftedBy(const std::vector<std::vector<float>>& start, double shift) {
    const auto now = Params();
    ASSERT_EQ(now.size(), start.size());
    for (size_t l = 0; l < now.size(); ++l) {
      for (size_t i = 0; i < now[l].size(); ++i) {
        ASSERT_NEAR(now[l][i], start[l][i] - shift, 1e-5) << "layer " << l << " element " << i;
      }
    }
  }

  // An update whose every element is `value`.
  PendingUpdate Update(uint64_t worker, const v1::Task& task, float value) {
    PendingUpdate u;
    u.worker_id = worker;
    u.task_id = task.task_id();
    u.base_version = task.base_version();
    u.steps_done = task.local_steps();
    u.tokens_learned = 100;
    for (const auto& layer : core_->spec().layers()) {
      u.layers.emplace_back(layer.num_elements(), value);
    }
    return u;
  }

  std::vector<std::vector<float>> Params() {
    std::vector<std::vector<float>> out;
    for (const auto& layer : core_->Snapshot().layers) out.push_back(*layer);
    return out;
  }

  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
  std::unique_ptr<ServerCore> core_;
};

TEST_F(ServerCoreTest, FirstRoundWaitsForMinWorkersThenAveragesBothUpdates) {
  const uint64_t a = Join();
  EXPECT_EQ(Request(a).kind(), v1::Task::WAIT);  // min_workers = 2
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_EQ(ta.kind(), v1::Task::TRAIN);
  ASSERT_EQ(tb.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta.base_version(), 0u);
  EXPECT_EQ(ta.local_steps(), 5u);
  EXPECT_NE(ta.seed(), tb.seed());
  EXPECT_EQ(Request(a).task_id(), ta.task_id());  // a repeated request gets the same task

  const auto before = Params();
  auto ra = core_->SubmitUpdate(Update(a, ta, 1.0f));
  ASSERT_THAT(ra, IsOk());
  EXPECT_FALSE(ra->applied());
  EXPECT_EQ(core_->version(), 0u);
  auto rb = core_->SubmitUpdate(Update(b, tb, 3.0f));
  ASSERT_THAT(rb, IsOk());
  EXPECT_TRUE(rb->applied());
  EXPECT_EQ(rb->version(), 1u);
  // SGD lr 0.5 on the average (1 + 3) / 2 = 2: every parameter moves by exactly -1.
  const auto after = Params();
  for (size_t l = 0; l < after.size(); ++l) {
    for (size_t i = 0; i < after[l].size(); ++i) {
      ASSERT_FLOAT_EQ(after[l][i], before[l][i] - 1.0f) << "layer " << l << " element " << i;
    }
  }
  EXPECT_EQ(core_->updates_applied(), 2u);
  EXPECT_EQ(metrics_.Value("aloe_model_version"), 1);
  EXPECT_EQ(metrics_.Value("aloe_updates_applied_total"), 2);
  EXPECT_EQ(metrics_.Value("aloe_tokens_learned_total"), 200);
}

TEST_F(ServerCoreTest, BadPushesAreRejectedAndLeaveParametersUnchanged) {
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  Request(b);
  const auto before = Params();

  // Unknown layer and wrong size are caught while the stream is assembled.
  v1::PushHeader header;
  header.set_worker_id(a);
  header.set_task_id(ta.task_id());
  header.set_base_version(0);
  header.set_steps_done(5);
  {
    UpdateAssembler assembler(core_->spec(), header);
    EXPECT_THAT(assembler.AddChunk(99, 0, std::string(8, '\0')),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown layer 99")));
  }
  {
    UpdateAssembler assembler(core_->spec(), header);
    const size_t n = core_->spec().layers(0).num_elements();
    EXPECT_THAT(assembler.AddChunk(0, 0, std::string((n + 1) * 4, '\0')),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("wrong size")));
  }
  {
    UpdateAssembler assembler(core_->spec(), header);
    float values[2] = {1.0f, std::nanf("")};
    EXPECT_THAT(assembler.AddChunk(0, 0, std::string(reinterpret_cast<char*>(values), 8)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-finite")));
  }
  {
    UpdateAssembler assembler(core_->spec(), header);
    EXPECT_THAT(std::move(assembler).Finish(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("incomplete")));
  }
  // Stale version.
  PendingUpdate stale = Update(a, ta, 1.0f);
  stale.base_version = 7;
  EXPECT_THAT(core_->SubmitUpdate(stale),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale version")));
  // Wrong shape reaching the core directly.
  PendingUpdate shape = Update(a, ta, 1.0f);
  shape.layers[1].pop_back();
  EXPECT_THAT(core_->SubmitUpdate(shape),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1")));
  // Unknown worker and a task that is not the worker's.
  EXPECT_THAT(core_->SubmitUpdate(Update(42, ta, 1.0f)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("worker 42")));
  PendingUpdate wrong_task = Update(a, ta, 1.0f);
  wrong_task.task_id += 100;
  EXPECT_THAT(core_->SubmitUpdate(wrong_task),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no open training task")));

  EXPECT_EQ(core_->version(), 0u);
  EXPECT_EQ(Params(), before);
  EXPECT_EQ(metrics_.Value("aloe_updates_rejected_total", {"stale"}), 2);
  EXPECT_EQ(metrics_.Value("aloe_updates_rejected_total", {"invalid_argument"}), 1);
  EXPECT_EQ(metrics_.Value("aloe_updates_rejected_total", {"unknown_worker"}), 1);
  EXPECT_TRUE(metrics_.Has("aloe_updates_rejected_total", {"permission_denied"}));  // zero
  EXPECT_EQ(metrics_.Value("aloe_updates_rejected_total", {"permission_denied"}), 0);

  // The valid push of the same task still goes through afterwards; a second one is refused.
  EXPECT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)), IsOk());
  EXPECT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no open training task")));
}

// The labelled catalogue: per data shard (learning progress, Eq. 2 probabilities, Eq. 3 LR),
// per live trainer (speed, planned steps; removed on leave), released groups and norms.
TEST_F(ServerCoreTest, PublishesShardTrainerReleaseAndNormMetrics) {
  // Nothing learned yet: p ∝ |D| = (1000, 3000) / 4000; t = 0 is the start of warmup: eta 0.
  EXPECT_DOUBLE_EQ(metrics_.Value("aloe_data_shard_sampling_probability", {"a"}), 0.25);
  EXPECT_DOUBLE_EQ(metrics_.Value("aloe_data_shard_sampling_probability", {"b"}), 0.75);
  EXPECT_TRUE(metrics_.Has("aloe_data_shard_learning_rate", {"a"}));
  EXPECT_EQ(metrics_.Value("aloe_data_shard_learning_rate", {"a"}), 0.0);

  const uint64_t a = Join();
  const uint64_t b = Join();
  const std::string ida = std::to_string(a);
  const std::string idb = std::to_string(b);
  v1::HeartbeatRequest hb;
  hb.set_worker_id(a);
  hb.set_steps_per_second(2.0);
  ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  EXPECT_EQ(metrics_.Value("aloe_trainer_steps_per_second", {ida, "w"}), 2.0);
  hb.set_steps_per_second(4.0);
  ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  // EMA with alpha 0.3: 0.3 * 4 + 0.7 * 2 = 2.6.
  EXPECT_NEAR(metrics_.Value("aloe_trainer_steps_per_second", {ida, "w"}), 2.6, 1e-12);

  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_EQ(ta.kind(), v1::Task::TRAIN);
  EXPECT_EQ(metrics_.Value("aloe_trainer_planned_steps", {ida, "w"}), 5);
  EXPECT_EQ(metrics_.Value("aloe_trainer_planned_steps", {idb, "w"}), 5);
  // Two tasks of 5 steps x 8 sequences x 8 tokens in flight.
  EXPECT_EQ(metrics_.Value("aloe_data_shard_tokens_in_flight", {"a"}) +
                metrics_.Value("aloe_data_shard_tokens_in_flight", {"b"}),
            2 * 5 * 8 * 8);

  PendingUpdate ua = Update(a, ta, 1.0f);
  ua.compute_seconds = 1.0;  // 5 steps in 1 s
  ASSERT_THAT(core_->SubmitUpdate(ua), IsOk());
  // b's layers' sums of squares as measured on arrival (UpdateAssembler's sum_squares): the
  // norm metric reports those instead of reading the update again.
  PendingUpdate ub = Update(b, tb, 3.0f);
  ub.layer_squares.assign(core_->spec().layers_size(), 49.0);
  ASSERT_TRUE(core_->wants_layer_squares());
  ASSERT_THAT(core_->SubmitUpdate(ub), IsOk());
  // 0.3 * 5 + 0.7 * 2.6 = 3.32.
  EXPECT_NEAR(metrics_.Value("aloe_trainer_steps_per_second", {ida, "w"}), 3.32, 1e-12);
  EXPECT_EQ(metrics_.Observations("aloe_grace_window_workers"), std::vector<double>{2});
  EXPECT_EQ(metrics_.Value("aloe_data_shard_tokens_in_flight", {"a"}), 0);
  EXPECT_EQ(metrics_.Value("aloe_data_shard_tokens_in_flight", {"b"}), 0);
  EXPECT_EQ(metrics_.Value("aloe_data_shard_tokens_learned", {"a"}) +
                metrics_.Value("aloe_data_shard_tokens_learned", {"b"}),
            200);
  // Each shard's LR position advanced by the 5 steps of each update applied on it, and the
  // rate is Eq. 3's warmup value there (lr 3e-3, warmup 50).
  for (const char* shard : {"a", "b"}) {
    const double t = metrics_.Value("aloe_data_shard_lr_step", {shard});
    EXPECT_EQ(std::fmod(t, 5.0), 0.0) << shard;
    EXPECT_NEAR(metrics_.Value("aloe_data_shard_learning_rate", {shard}),
                t * static_cast<double>(3e-3f) / 50, 1e-12);
  }
  EXPECT_EQ(metrics_.Value("aloe_data_shard_lr_step", {"a"}) +
                metrics_.Value("aloe_data_shard_lr_step", {"b"}),
            10);
  // One norm per (update, layer): a constant update of value v has norm v * sqrt(n).
  const std::vector<double> norms = metrics_.Observations("aloe_pseudo_gradient_norm");
  const int layers = core_->spec().layers_size();
  ASSERT_EQ(norms.size(), 2u * layers);
  EXPECT_NEAR(norms[0], std::sqrt(double(core_->spec().layers(0).num_elements())), 1e-4);
  for (int l = 0; l < layers; ++l) EXPECT_EQ(norms[layers + l], 7.0) << "measured, layer " << l;

  v1::LeaveRequest leave;
  leave.set_worker_id(a);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  EXPECT_FALSE(metrics_.Has("aloe_trainer_steps_per_second", {ida, "w"}));
  EXPECT_FALSE(metrics_.Has("aloe_trainer_planned_steps", {ida, "w"}));
  EXPECT_TRUE(metrics_.Has("aloe_trainer_planned_steps", {idb, "w"}));
}

// FSDP workers push one slice of every layer per rank; the server stages the slices of an
// update, accepts a retried slice idempotently, and aggregates the merged update once complete.
TEST_F(ServerCoreTest, SlicedUpdateIsStagedUntilEverySliceArrived) {
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  auto slice_of = [&](uint32_t slice, float value) {
    PendingUpdate u = Update(a, ta, value);
    u.update_id = 9;
    u.slice = slice;
    u.slices = 2;
    for (auto& layer : u.layers) {
      const auto [first, last] = SliceRange(layer.size(), 2, slice);
      for (size_t i = 0; i < layer.size(); ++i) {
        if (i < first || i >= last) layer[i] = 0;
      }
    }
    return u;
  };
  const auto before = Params();
  auto r0 = core_->SubmitUpdate(slice_of(0, 7.0f));  // superseded below by the retry
  ASSERT_THAT(r0, IsOk());
  EXPECT_TRUE(r0->staged());
  EXPECT_EQ(r0->slices_received(), 1u);
  auto retry = core_->SubmitUpdate(slice_of(0, 1.0f));
  ASSERT_THAT(retry, IsOk());
  EXPECT_EQ(retry->slices_received(), 1u);
  // A slice that disagrees about the work done is refused; the staged slice stays.
  PendingUpdate odd = slice_of(1, 1.0f);
  odd.steps_done += 1;
  EXPECT_THAT(core_->SubmitUpdate(odd),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("other slices reported")));
  PendingUpdate out_of_range = slice_of(1, 1.0f);
  out_of_range.slice = 2;
  EXPECT_THAT(core_->SubmitUpdate(out_of_range),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slice 2 of 2")));
  EXPECT_EQ(core_->version(), 0u);
  EXPECT_EQ(Params(), before);

  auto r1 = core_->SubmitUpdate(slice_of(1, 1.0f));
  ASSERT_THAT(r1, IsOk());
  EXPECT_FALSE(r1->staged());
  EXPECT_FALSE(r1->applied());  // the round still waits for b
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 3.0f)), IsOk());
  EXPECT_EQ(core_->version(), 1u);
  // SGD lr 0.5 on the average of the merged all-ones update and b's 3: every parameter -1.
  const auto after = Params();
  for (size_t l = 0; l < after.size(); ++l) {
    for (size_t i = 0; i < after[l].size(); ++i) {
      ASSERT_FLOAT_EQ(after[l][i], before[l][i] - 1.0f) << "layer " << l << " element " << i;
    }
  }
  v1::PullRequest pull;
  pull.set_worker_id(a);
  pull.set_latest(true);
  pull.set_slice(3);
  pull.set_slices(3);
  EXPECT_THAT(core_->SnapshotFor(pull),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slice 3 of 3")));
  pull.set_slice(2);
  EXPECT_THAT(core_->SnapshotFor(pull), IsOk());
}

TEST_F(ServerCoreTest, ExpiredWorkerIsNotWaitedForAndItsLatePushIsRejected) {
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 2.0f)), IsOk());
  // a keeps heartbeating, b goes silent past its lease.
  clock_.Advance(absl::Seconds(6));
  v1::HeartbeatRequest hb;
  hb.set_worker_id(a);
  ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  clock_.Advance(absl::Seconds(6));
  core_->Tick();
  EXPECT_EQ(core_->version(), 1u);  // the round closed without b
  EXPECT_EQ(metrics_.Value("aloe_workers_expired_total"), 1);
  EXPECT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not a live member")));
  // A new round opens for the survivor alone.
  const v1::Task next = Request(a);
  EXPECT_EQ(next.kind(), v1::Task::TRAIN);
  EXPECT_EQ(next.base_version(), 1u);
}

TEST_F(ServerCoreTest, LateJoinerWaitsForTheNextRound) {
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  const uint64_t c = Join();
  EXPECT_EQ(Request(c).kind(), v1::Task::WAIT);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)), IsOk());
  const v1::Task tc = Request(c);
  EXPECT_EQ(tc.kind(), v1::Task::TRAIN);
  EXPECT_EQ(tc.base_version(), 1u);
}

TEST_F(ServerCoreTest, EvaluatorGetsInitialAndFinalVersionsThenStop) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_aggregation()->set_min_workers(1);
  config.set_max_versions(2);
  config.set_eval_every(10);
  Make(config);
  const uint64_t e = Join(v1::ROLE_EVALUATOR);
  const uint64_t a = Join();
  v1::Task eval = Request(e);
  ASSERT_EQ(eval.kind(), v1::Task::EVAL);
  EXPECT_EQ(eval.base_version(), 0u);
  v1::EvalReport report;
  report.set_worker_id(e);
  report.set_task_id(eval.task_id());
  report.set_version(0);
  report.set_loss(std::nan(""));
  report.set_tokens(10);
  EXPECT_THAT(core_->ReportEval(report),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss")));
  report.set_loss(2.5);
  ASSERT_THAT(core_->ReportEval(report), IsOk());
  EXPECT_DOUBLE_EQ(metrics_.Value("aloe_eval_perplexity"), std::exp(2.5));
  EXPECT_EQ(Request(e).kind(), v1::Task::WAIT);

  for (int round = 0; round < 2; ++round) {
    const v1::Task t = Request(a);
    ASSERT_EQ(t.kind(), v1::Task::TRAIN);
    ASSERT_THAT(core_->SubmitUpdate(Update(a, t, 0.1f)), IsOk());
  }
  EXPECT_TRUE(core_->stopping());
  EXPECT_EQ(Request(a).kind(), v1::Task::STOP);
  eval = Request(e);
  ASSERT_EQ(eval.kind(), v1::Task::EVAL);  // the final version is always evaluated
  EXPECT_EQ(eval.base_version(), 2u);
  report.set_task_id(eval.task_id());
  report.set_version(2);
  report.set_loss(2.0);
  ASSERT_THAT(core_->ReportEval(report), IsOk());
  EXPECT_EQ(Request(e).kind(), v1::Task::STOP);
  EXPECT_FALSE(core_->Finished());
  v1::LeaveRequest leave;
  leave.set_worker_id(a);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  leave.set_worker_id(e);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  EXPECT_TRUE(core_->Finished());
  ASSERT_EQ(core_->eval_history().size(), 2u);
  EXPECT_EQ(core_->eval_history().back().version, 2u);
}

// With the EDiT penalty on, a sync round is aggregated per layer with the norm-softmax weights
// of paper 000 Eq. 2 (and clipped, Eq. 4), not with the plain mean of the other tests.
TEST_F(ServerCoreTest, PenaltyWeighsASyncRoundBySoftmaxOfLayerNorms) {
  EXPECT_EQ(core_->penalty(), nullptr);         // off by default
  v1::ServerConfig config = TinyConfig();       // SGD lr 0.5
  config.mutable_penalty()->set_enabled(true);  // defaults: T = 1, phi = 10, warmup 120
  Make(config);
  ASSERT_NE(core_->penalty(), nullptr);
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  const auto before = Params();
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 0.1f)), IsOk());
  auto reply = core_->SubmitUpdate(Update(b, tb, 0.3f));
  ASSERT_THAT(reply, IsOk());
  ASSERT_TRUE(reply->applied());
  const auto after = Params();

  size_t differs_from_mean = 0;
  for (size_t l = 0; l < after.size(); ++l) {
    // Layer norms of the two constant updates, w_a = e^-Ga / (e^-Ga + e^-Gb), then Eq. 3-5.
    const double n = static_cast<double>(after[l].size());
    const double ga = std::sqrt(n) * 0.1f;
    const double gb = std::sqrt(n) * 0.3f;
    const double wa = 1 / (1 + std::exp(ga - gb));
    const double g = wa * 0.1f + (1 - wa) * 0.3f;
    const double beta = std::min(10 / (std::sqrt(n) * g + 1e-6), 1.0);
    const double delta = -0.5 * beta * g;
    if (std::abs(delta - (-0.5 * 0.2)) > 1e-3) ++differs_from_mean;
    for (size_t i = 0; i < after[l].size(); ++i) {
      ASSERT_NEAR(after[l][i], before[l][i] + delta, 2e-6) << "layer " << l << " element " << i;
    }
  }
  EXPECT_GT(differs_from_mean, 0u);
  EXPECT_EQ(metrics_.Observations("aloe_penalty_weight").size(), 2 * after.size());
  EXPECT_EQ(metrics_.Observations("aloe_pseudo_gradient_norm").size(), 2 * after.size());
  EXPECT_EQ(metrics_.Observations("aloe_penalty_clip_coefficient").size(), after.size());
  EXPECT_EQ(metrics_.Value("aloe_penalty_anomalies_total"), 0);
  EXPECT_EQ(metrics_.Value("aloe_penalty_rollbacks_total"), 0);
  EXPECT_EQ(core_->penalty()->Stats(0, a)->count, 1u);
}

TEST_F(ServerCoreTest, PenaltyRollsBackEveryLayerWhenAllWorkersSpike) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_penalty()->set_enabled(true);
  config.mutable_penalty()->set_warmup(2);
  Make(config);
  const uint64_t a = Join();
  const uint64_t b = Join();
  auto round = [&](float value) {
    const v1::Task ta = Request(a);
    const v1::Task tb = Request(b);
    ASSERT_EQ(ta.kind(), v1::Task::TRAIN);
    ASSERT_EQ(tb.kind(), v1::Task::TRAIN);
    ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, value)), IsOk());
    auto reply = core_->SubmitUpdate(Update(b, tb, value));
    ASSERT_THAT(reply, IsOk());
    ASSERT_TRUE(reply->applied());
  };
  // Warmup of two rounds; in units of sqrt(layer size): mu = 0.1 + 0.02*0.2 = 0.104,
  // sigma = sqrt(0.02)*0.98*0.2 = 0.0277.
  round(0.1f);
  round(0.3f);
  const auto warm = Params();
  round(5.0f);  // z ~ 177 for both workers in every layer: nothing is applied
  EXPECT_EQ(core_->version(), 3u);
  EXPECT_EQ(Params(), warm);
  const double layers = static_cast<double>(warm.size());
  EXPECT_EQ(metrics_.Value("aloe_penalty_rollbacks_total"), layers);
  EXPECT_EQ(metrics_.Value("aloe_penalty_anomalies_total"), 2 * layers);
  round(0.12f);  // z ~ 0.6: applied again
  EXPECT_NE(Params(), warm);
  EXPECT_EQ(metrics_.Value("aloe_penalty_rollbacks_total"), layers);
}

TEST_F(ServerCoreTest, PullOfAnOldVersionIsRefused) {
  const uint64_t a = Join();
  v1::PullRequest pull;
  pull.set_worker_id(a);
  pull.set_version(3);
  EXPECT_THAT(core_->SnapshotFor(pull),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("version 3")));
  pull.set_latest(true);
  EXPECT_THAT(core_->SnapshotFor(pull), IsOk());
  pull.set_worker_id(77);
  EXPECT_THAT(core_->SnapshotFor(pull), StatusIs(absl::StatusCode::kNotFound, HasSubstr("77")));
}

TEST_F(ServerCoreTest, AnObserverReadsTheModelButTakesNoTaskAndIsNoTrainer) {
  v1::JoinRequest request;
  request.set_name("aloe-export");
  request.set_role(v1::ROLE_OBSERVER);
  request.set_model_fingerprint("not-this-model");  // an observer reads any model
  absl::StatusOr<v1::JoinReply> joined = core_->Join(request);
  ASSERT_THAT(joined, IsOk());
  const uint64_t observer = joined->worker_id();
  EXPECT_EQ(joined->model_spec().layers_size(), core_->spec().layers_size());
  v1::TaskRequest ask;
  ask.set_worker_id(observer);
  EXPECT_THAT(core_->RequestTask(ask),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("takes no tasks")));

  // Not counted as a trainer: the first round still waits for min_workers 2 trainers.
  const uint64_t a = Join();
  EXPECT_EQ(Request(a).kind(), v1::Task::WAIT);
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 3.0f)), IsOk());
  ASSERT_EQ(core_->version(), 1u);

  v1::PullRequest pull;
  pull.set_worker_id(observer);
  pull.set_latest(true);
  absl::StatusOr<ModelSnapshot> latest = core_->SnapshotFor(pull);
  ASSERT_THAT(latest, IsOk());
  EXPECT_EQ(latest->version, 1u);
  pull.set_latest(false);
  pull.set_version(0);
  EXPECT_THAT(core_->SnapshotFor(pull),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("version 0 is not available (at version 1; retained: [])")));

  const std::vector<LiveWorker> live = core_->LiveWorkers();
  auto it =
      std::find_if(live.begin(), live.end(), [&](const LiveWorker& w) { return w.id == observer; });
  ASSERT_NE(it, live.end());
  EXPECT_EQ(it->role, v1::ROLE_OBSERVER);
  EXPECT_EQ(it->state, "reading");
  v1::LeaveRequest leave;
  leave.set_worker_id(observer);
  EXPECT_THAT(core_->Leave(leave), IsOk());
  EXPECT_EQ(metrics_.Value("aloe_live_workers"), 2);
}

}  // namespace
}  // namespace aloe::server

namespace aloe::server {
namespace {

// An update whose element i of layer l is a deterministic pseudo-random value of (seed, l, i).
PendingUpdate VariedUpdate(const v1::ModelSpec& spec, uint64_t worker, const v1::Task& task,
                           uint32_t seed) {
  PendingUpdate u;
  u.worker_id = worker;
  u.task_id = task.task_id();
  u.base_version = task.base_version();
  u.steps_done = task.local_steps();
  u.tokens_learned = 10;
  u.compute_seconds = 1.0;
  for (const auto& layer : spec.layers()) {
    std::vector<float> g(layer.num_elements());
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = static_cast<float>(
                 ((seed * 2654435761u + layer.id() * 40503u + i * 977u) % 2001) / 1000.0 - 1.0) *
             0.01f;
    }
    u.layers.push_back(std::move(g));
  }
  return u;
}

class AsyncServerCoreTest : public ServerCoreTest {
 protected:
  v1::ServerConfig AsyncConfig(double grace_seconds) {
    v1::ServerConfig config = TinyConfig();
    config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
    config.mutable_aggregation()->set_grace_seconds(grace_seconds);
    config.mutable_aggregation()->set_min_workers(1);
    return config;
  }
};

TEST_F(AsyncServerCoreTest, InfiniteGraceWithEqualSpeedsMatchesSyncDiLoCo) {
  // Sync DiLoCo with outer Nesterov ...
  v1::ServerConfig sync = TinyConfig();
  sync.mutable_outer_optimizer()->set_type(v1::OUTER_NESTEROV);
  sync.mutable_outer_optimizer()->set_lr(0.7f);
  sync.mutable_outer_optimizer()->set_momentum(0.9f);
  Make(sync);
  uint64_t a = Join(), b = Join();
  for (uint32_t round = 0; round < 4; ++round) {
    const v1::Task ta = Request(a), tb = Request(b);
    ASSERT_THAT(core_->SubmitUpdate(VariedUpdate(core_->spec(), a, ta, 2 * round)), IsOk());
    ASSERT_THAT(core_->SubmitUpdate(VariedUpdate(core_->spec(), b, tb, 2 * round + 1)), IsOk());
  }
  ASSERT_EQ(core_->version(), 4u);
  const auto sync_params = Params();

  // ... equals async with tau_grace = inf and Delayed Nesterov with N = k = 2 (paper 002):
  // the two updates of a window are applied one by one, released together, and the DN
  // momentum step at every 2nd update makes the pair one Nesterov step on their average.
  v1::ServerConfig async = AsyncConfig(std::numeric_limits<double>::infinity());
  *async.mutable_outer_optimizer() = sync.outer_optimizer();
  async.mutable_outer_optimizer()->set_type(v1::OUTER_DELAYED_NESTEROV);
  async.mutable_outer_optimizer()->set_dn_buffer_size(2);
  Make(async);
  a = Join();
  b = Join();
  for (uint32_t round = 0; round < 4; ++round) {
    const v1::Task ta = Request(a), tb = Request(b);
    ASSERT_EQ(ta.kind(), v1::Task::TRAIN);
    ASSERT_EQ(tb.kind(), v1::Task::TRAIN);
    EXPECT_EQ(ta.base_version(), 2 * round);
    EXPECT_EQ(tb.base_version(), 2 * round);  // released together, one version
    ASSERT_THAT(core_->SubmitUpdate(VariedUpdate(core_->spec(), a, ta, 2 * round)), IsOk());
    EXPECT_EQ(Request(a).kind(), v1::Task::WAIT);  // waits for the window
    auto rb = core_->SubmitUpdate(VariedUpdate(core_->spec(), b, tb, 2 * round + 1));
    ASSERT_THAT(rb, IsOk());
    EXPECT_EQ(rb->staleness(), 1u);
  }
  ASSERT_EQ(core_->version(), 8u);
  const auto async_params = Params();
  // Equal up to float rounding (the sums are associated differently).
  double max_diff = 0;
  for (size_t l = 0; l < sync_params.size(); ++l) {
    for (size_t i = 0; i < sync_params[l].size(); ++i) {
      max_diff = std::max(max_diff, std::abs(double(sync_params[l][i]) - async_params[l][i]));
    }
  }
  EXPECT_LT(max_diff, 1e-6);
}

TEST_F(AsyncServerCoreTest, ZeroGraceAppliesOnArrivalAndServesOlderBaseVersions) {
  Make(AsyncConfig(0));
  const uint64_t a = Join(), b = Join();
  const v1::Task ta = Request(a), tb = Request(b);
  ASSERT_EQ(tb.kind(), v1::Task::TRAIN);
  auto ra = core_->SubmitUpdate(Update(a, ta, 1.0f));
  ASSERT_THAT(ra, IsOk());
  EXPECT_TRUE(ra->applied());
  EXPECT_EQ(core_->version(), 1u);
  const v1::Task ta2 = Request(a);  // released at once
  ASSERT_EQ(ta2.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta2.base_version(), 1u);
  auto rb = core_->SubmitUpdate(Update(b, tb, 1.0f));
  ASSERT_THAT(rb, IsOk());
  EXPECT_EQ(rb->staleness(), 1u);  // applied to v1, started from v0
  EXPECT_EQ(core_->version(), 2u);
  // a's task still pulls v1 although the model is at v2.
  v1::PullRequest pull;
  pull.set_worker_id(a);
  pull.set_version(1);
  auto snapshot = core_->SnapshotFor(pull);
  ASSERT_THAT(snapshot, IsOk());
  EXPECT_EQ(snapshot->version, 1u);
  EXPECT_EQ(metrics_.Observations("aloe_update_staleness"), (std::vector<double>{0, 1}));
}

// Overlap (TaskRequest.ahead): a look-ahead task while the open one runs, from the current
// version; pushes must come in task order; the look-ahead task becomes the open one when its
// predecessor is pushed, and its update counts one more version of staleness.
TEST_F(AsyncServerCoreTest,
       LookAheadTaskStartsFromTheCurrentVersionAndIsPushedAfterItsPredecessor) {
  Make(AsyncConfig(0));
  const uint64_t a = Join();
  const v1::Task t1 = Request(a);
  v1::TaskRequest ahead;
  ahead.set_worker_id(a);
  ahead.set_ahead(true);
  auto t2 = core_->RequestTask(ahead);
  ASSERT_THAT(t2, IsOk());
  ASSERT_EQ(t2->kind(), v1::Task::TRAIN);
  EXPECT_NE(t2->task_id(), t1.task_id());
  EXPECT_EQ(t2->base_version(), 0u);
  EXPECT_EQ(core_->RequestTask(ahead)->task_id(), t2->task_id());  // a retry: the same task
  EXPECT_EQ(Request(a).task_id(), t1.task_id());                   // the open task is still t1
  EXPECT_EQ(core_->open_tasks(), 2u);
  EXPECT_EQ(metrics_.Value("aloe_tasks_ahead_total"), 1);
  const auto before = Params();
  EXPECT_THAT(core_->SubmitUpdate(Update(a, *t2, 1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no open training task")));
  EXPECT_EQ(Params(), before);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, t1, 1.0f)), IsOk());  // v1
  auto r2 = core_->SubmitUpdate(Update(a, *t2, 1.0f));
  ASSERT_THAT(r2, IsOk());
  EXPECT_EQ(r2->staleness(), 1u);
  EXPECT_EQ(core_->version(), 2u);
  EXPECT_EQ(metrics_.Observations("aloe_update_staleness"), (std::vector<double>{0, 1}));
  EXPECT_EQ(core_->open_tasks(), 0u);
  EXPECT_EQ(Request(a).base_version(), 2u);  // back to the usual flow
}

TEST_F(AsyncServerCoreTest, LookAheadWaitsWhileDrainingAndStopsAtTheLastVersion) {
  v1::TaskRequest ahead;
  ahead.set_ahead(true);
  // max_versions 2: the open task makes v1, one look-ahead task v2, then no more.
  v1::ServerConfig config = AsyncConfig(0);
  config.set_max_versions(2);
  Make(config);
  const uint64_t a = Join();
  const v1::Task t1 = Request(a);
  ahead.set_worker_id(a);
  const v1::Task t2 = *core_->RequestTask(ahead);
  ASSERT_EQ(t2.kind(), v1::Task::TRAIN);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, t1, 1.0f)), IsOk());
  EXPECT_EQ(core_->RequestTask(ahead)->kind(), v1::Task::STOP);
  // A sync round: the open round makes v1 and the look-ahead task's round v2.
  v1::ServerConfig sync = TinyConfig();
  sync.mutable_aggregation()->set_min_workers(1);
  sync.set_max_versions(2);
  Make(sync);
  const uint64_t s = Join();
  const v1::Task s1 = Request(s);
  const v1::Task s2 = Ahead(s);
  ASSERT_EQ(s2.kind(), v1::Task::TRAIN);
  ASSERT_THAT(core_->SubmitUpdate(Update(s, s1, 1.0f)), IsOk());
  EXPECT_EQ(Ahead(s).kind(), v1::Task::STOP);
  // Draining: no new work, look-ahead included.
  Make(AsyncConfig(0));
  const uint64_t d = Join();
  ASSERT_EQ(Request(d).kind(), v1::Task::TRAIN);
  core_->BeginDrain();
  const v1::Task drained = Ahead(d);
  EXPECT_EQ(drained.kind(), v1::Task::WAIT);
  EXPECT_TRUE(drained.draining());
  EXPECT_EQ(core_->open_tasks(), 1u);
}

// One-step-delay overlap in sync rounds (docs/algorithms.md): before round 0 closes, the
// overlapping worker a gets its round-1 task from version 0, the version before round 0's
// update; its push joins round 1 with staleness 1 (0 for b, which does not overlap); a's task
// after that starts from version 1, before round 1 closes.
TEST_F(ServerCoreTest, OverlappedWorkerStartsTheNextRoundAheadAndJoinsItOneVersionStaler) {
  const uint64_t a = Join(), b = Join();
  const auto theta0 = Params();
  const v1::Task ta0 = Request(a), tb0 = Request(b);
  const v1::Task ta1 = Ahead(a);
  ASSERT_EQ(ta1.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta1.base_version(), 0u);
  EXPECT_NE(ta1.task_id(), ta0.task_id());
  EXPECT_EQ(Ahead(a).task_id(), ta1.task_id());  // a retry: the same task
  auto ra0 = core_->SubmitUpdate(Update(a, ta0, 1.0f));
  ASSERT_THAT(ra0, IsOk());
  EXPECT_FALSE(ra0->applied());
  // ta1 is a's open task now; the task after it waits for round 0 to close.
  EXPECT_EQ(Request(a).task_id(), ta1.task_id());
  EXPECT_EQ(Ahead(a).kind(), v1::Task::WAIT);
  auto rb0 = core_->SubmitUpdate(Update(b, tb0, 3.0f));
  ASSERT_THAT(rb0, IsOk());
  EXPECT_TRUE(rb0->applied());
  EXPECT_EQ(core_->version(), 1u);
  ExpectShiftedBy(theta0, 0.5 * (1 + 3) / 2);  // outer SGD lr 0.5 on the mean
  // Round 1 is open with a in it: a's next task starts from its version before it closes.
  const v1::Task ta2 = Ahead(a);
  ASSERT_EQ(ta2.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta2.base_version(), 1u);
  auto ra1 = core_->SubmitUpdate(Update(a, ta1, 2.0f));
  ASSERT_THAT(ra1, IsOk());
  EXPECT_FALSE(ra1->applied());  // round 1 waits for b
  EXPECT_EQ(ra1->staleness(), 1u);
  const v1::Task tb1 = Request(b);
  ASSERT_EQ(tb1.kind(), v1::Task::TRAIN);
  EXPECT_EQ(tb1.base_version(), 1u);
  auto rb1 = core_->SubmitUpdate(Update(b, tb1, 4.0f));
  ASSERT_THAT(rb1, IsOk());
  EXPECT_TRUE(rb1->applied());
  EXPECT_EQ(rb1->staleness(), 0u);
  EXPECT_EQ(core_->version(), 2u);
  ExpectShiftedBy(theta0, 0.5 * (1 + 3) / 2 + 0.5 * (2 + 4) / 2);
  EXPECT_EQ(core_->updates_applied(), 4u);  // two rounds of two updates each
  EXPECT_EQ(metrics_.Observations("aloe_grace_window_workers"), (std::vector<double>{2, 2}));
  EXPECT_EQ(metrics_.Observations("aloe_update_staleness"), (std::vector<double>{0, 0, 1, 0}));
  EXPECT_EQ(metrics_.Value("aloe_tasks_ahead_total"), 2);
  // Round 2 holds a's ta2 (from version 1) and b's next task (from version 2).
  EXPECT_EQ(Request(a).task_id(), ta2.task_id());
  EXPECT_EQ(Request(b).base_version(), 2u);
  EXPECT_EQ(core_->open_tasks(), 2u);
}

// An overlapped push that arrives before its round opens (round 0 still waits for b) is held
// for round 1: round 0 closes with a's and b's round-0 updates only, and round 1 applies a's
// update discounted as staleness 1 ((1 + 1)^-1 with staleness_exponent 1). a, having pushed its
// round-1 work, starts its round-2 work from version 1 at once: it stays one step behind.
TEST_F(ServerCoreTest, AnOverlappedPushBeforeItsRoundOpensIsHeldForItWithItsStaleness) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_outer_optimizer()->set_staleness_exponent(1.0f);
  Make(config);
  const uint64_t a = Join(), b = Join();
  const auto theta0 = Params();
  const v1::Task ta0 = Request(a), tb0 = Request(b);
  const v1::Task ta1 = Ahead(a);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta0, 1.0f)), IsOk());
  auto ra1 = core_->SubmitUpdate(Update(a, ta1, 2.0f));
  ASSERT_THAT(ra1, IsOk());
  EXPECT_FALSE(ra1->applied());
  EXPECT_EQ(ra1->staleness(), 1u);
  EXPECT_EQ(core_->version(), 0u);
  EXPECT_EQ(Request(a).kind(), v1::Task::WAIT);  // a's round-0 push is in: round 0 must close
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb0, 3.0f)), IsOk());
  EXPECT_EQ(core_->version(), 1u);
  EXPECT_EQ(core_->updates_applied(), 2u);
  ExpectShiftedBy(theta0, 0.5 * (1 + 3) / 2);
  const v1::Task ta2 = Request(a);
  ASSERT_EQ(ta2.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta2.base_version(), 1u);
  const v1::Task tb1 = Request(b);
  EXPECT_EQ(tb1.base_version(), 1u);
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb1, 4.0f)), IsOk());
  EXPECT_EQ(core_->version(), 2u);
  ExpectShiftedBy(theta0, 0.5 * (1 + 3) / 2 + 0.5 * (2.0 / 2 + 4) / 2);
  EXPECT_EQ(metrics_.Observations("aloe_update_staleness"), (std::vector<double>{0, 1, 0, 0}));
  // ta2 joins round 2, one version staler than b's.
  auto ra2 = core_->SubmitUpdate(Update(a, ta2, 1.0f));
  ASSERT_THAT(ra2, IsOk());
  EXPECT_EQ(ra2->staleness(), 1u);
}

// Membership changes release look-ahead work: a worker that leaves with a look-ahead task gives
// its tokens back and is not waited for; one whose lease expires while its look-ahead task is in
// the next round is not waited for there either.
TEST_F(ServerCoreTest, OverlappedWorkersThatLeaveOrExpireAreNotWaitedFor) {
  const uint64_t a = Join(), b = Join();
  ASSERT_EQ(Request(a).kind(), v1::Task::TRAIN);
  const v1::Task tb0 = Request(b);
  ASSERT_EQ(Ahead(a).kind(), v1::Task::TRAIN);
  EXPECT_EQ(core_->open_tasks(), 3u);
  auto in_flight = [&] {
    uint64_t tokens = 0;
    for (size_t i = 0; i < core_->sampler().size(); ++i) {
      tokens += core_->sampler().tokens_in_flight(i);
    }
    return tokens;
  };
  const uint64_t per_task = in_flight() / 3;
  v1::LeaveRequest leave;
  leave.set_worker_id(a);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  EXPECT_EQ(core_->open_tasks(), 1u);
  EXPECT_EQ(in_flight(), per_task);  // only b's task is still in flight
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb0, 1.0f)), IsOk());
  EXPECT_EQ(core_->version(), 1u);  // round 0 closed without a
  EXPECT_EQ(core_->updates_applied(), 1u);

  // c overlaps: its look-ahead task is in round 1 when its lease expires.
  const uint64_t c = Join();
  const v1::Task tb1 = Request(b), tc1 = Request(c);
  ASSERT_EQ(tc1.kind(), v1::Task::TRAIN);
  ASSERT_EQ(Ahead(c).kind(), v1::Task::TRAIN);
  ASSERT_THAT(core_->SubmitUpdate(Update(c, tc1, 1.0f)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb1, 1.0f)), IsOk());
  EXPECT_EQ(core_->version(), 2u);
  const v1::Task tb2 = Request(b);
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb2, 1.0f)), IsOk());
  EXPECT_EQ(core_->version(), 2u);  // round 2 waits for c's look-ahead task
  clock_.Advance(absl::Seconds(6));
  v1::HeartbeatRequest hb;
  hb.set_worker_id(b);
  ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  clock_.Advance(absl::Seconds(6));
  core_->Tick();
  EXPECT_EQ(metrics_.Value("aloe_workers_expired_total"), 1);
  EXPECT_EQ(core_->version(), 3u);  // closed without c
  EXPECT_EQ(core_->open_tasks(), 0u);
  EXPECT_EQ(in_flight(), 0u);
}

// A checkpoint captured while a look-ahead task is open (and an overlapped push is held for the
// next sync round) holds the state right after the outer step: the held push and the open tasks
// are not part of it, and a core restored from it opens its next round afresh.
TEST_F(ServerCoreTest, CheckpointWithLookAheadWorkOpenResumesAtItsVersion) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_checkpoint()->set_dir("unused");
  config.mutable_checkpoint()->set_every_versions(1);
  Make(config);
  const uint64_t a = Join(), b = Join();
  const v1::Task ta0 = Request(a), tb0 = Request(b);
  const v1::Task ta1 = Ahead(a);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta0, 1.0f)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta1, 2.0f)), IsOk());  // held for round 1
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb0, 3.0f)), IsOk());  // v1: due
  std::vector<v1::ServerCheckpoint> taken = core_->TakeDueCheckpoints();
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].version(), 1u);
  EXPECT_EQ(taken[0].updates_applied(), 2u);
  uint64_t learned = 0;
  for (uint64_t tokens : taken[0].shard_tokens()) learned += tokens;
  EXPECT_EQ(learned, 200u);  // ta0's and tb0's, not the held push's

  const auto params = Params();
  Make(config);
  ASSERT_THAT(core_->RestoreCheckpoint(taken[0]), IsOk());
  EXPECT_EQ(core_->version(), 1u);
  EXPECT_EQ(Params(), params);
  const uint64_t c = Join(), d = Join();
  const v1::Task tc = Request(c), td = Request(d);
  ASSERT_EQ(tc.kind(), v1::Task::TRAIN);
  EXPECT_EQ(tc.base_version(), 1u);
  EXPECT_GT(tc.task_id(), ta1.task_id());  // no id of the lost tasks is handed out again
  ASSERT_THAT(core_->SubmitUpdate(Update(c, tc, 1.0f)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(Update(d, td, 1.0f)), IsOk());
  EXPECT_EQ(core_->version(), 2u);
  EXPECT_EQ(core_->updates_applied(), 4u);
}

// One-step-delay overlap behind a grace window: a look-ahead task waits for the close of the
// window its worker's last push is in and starts from the version at the close, like the other
// members' next tasks; overlapped pushes join windows like any other and are discounted by their
// staleness ((1 + s)^-1).
TEST_F(AsyncServerCoreTest, GraceWindowHandsLookAheadTasksOutAtTheCloseAndBatchesTheirPushes) {
  v1::ServerConfig config = AsyncConfig(2);
  config.mutable_outer_optimizer()->set_staleness_exponent(1.0f);
  Make(config);
  const uint64_t a = Join(), b = Join();
  const auto theta0 = Params();
  const v1::Task ta0 = Request(a), tb0 = Request(b);
  const v1::Task ta1 = Ahead(a);  // no push of a waits for a window: at once
  ASSERT_EQ(ta1.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta1.base_version(), 0u);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta0, 1.0f)), IsOk());  // v1, opens a window
  EXPECT_EQ(Ahead(a).kind(), v1::Task::WAIT);
  clock_.Advance(absl::Seconds(2));
  const v1::Task ta2 = Ahead(a);  // the window closed at its grace, releasing a at v1
  ASSERT_EQ(ta2.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta2.base_version(), 1u);
  auto rb0 = core_->SubmitUpdate(Update(b, tb0, 3.0f));  // v2, opens the next window
  ASSERT_THAT(rb0, IsOk());
  EXPECT_EQ(rb0->staleness(), 1u);
  auto ra1 = core_->SubmitUpdate(Update(a, ta1, 2.0f));  // v3: joins it, and everyone is in
  ASSERT_THAT(ra1, IsOk());
  EXPECT_EQ(ra1->staleness(), 2u);
  EXPECT_EQ(core_->version(), 3u);
  ExpectShiftedBy(theta0, 0.5 * (1 + 3.0 / 2 + 2.0 / 3));
  // Both members of that window start from the version at its close.
  EXPECT_EQ(Request(b).base_version(), 3u);
  const v1::Task ta3 = Ahead(a);
  ASSERT_EQ(ta3.kind(), v1::Task::TRAIN);
  EXPECT_EQ(ta3.base_version(), 3u);
  EXPECT_EQ(metrics_.Observations("aloe_grace_window_workers"), (std::vector<double>{1, 2}));
  EXPECT_EQ(metrics_.Observations("aloe_update_staleness"), (std::vector<double>{0, 1, 2}));
  // A worker with a look-ahead task that leaves gives both tasks' tokens back.
  v1::LeaveRequest leave;
  leave.set_worker_id(a);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  EXPECT_EQ(core_->open_tasks(), 1u);
}

TEST_F(AsyncServerCoreTest, TooStaleUpdateIsDroppedAndChangesNothing) {
  v1::ServerConfig config = AsyncConfig(0);
  config.mutable_outer_optimizer()->set_max_staleness(1);
  Make(config);
  const uint64_t a = Join(), b = Join();
  const v1::Task ta = Request(a), tb = Request(b);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)), IsOk());          // v1
  ASSERT_THAT(core_->SubmitUpdate(Update(a, Request(a), 1.0f)), IsOk());  // v2
  const auto before = Params();
  // b started from v0: staleness 2 > 1.
  EXPECT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("staleness")));
  EXPECT_EQ(Params(), before);
  EXPECT_EQ(core_->version(), 2u);
  const v1::Task again = Request(b);  // b starts afresh from the current version
  EXPECT_EQ(again.kind(), v1::Task::TRAIN);
  EXPECT_EQ(again.base_version(), 2u);
}

TEST_F(AsyncServerCoreTest, DyLUStepsFollowReportedSpeedsAndTimeBudgetIsSent) {
  v1::ServerConfig config = AsyncConfig(0);
  config.set_local_steps(50);
  config.mutable_local_work()->set_mode(v1::LOCAL_WORK_DYLU);
  Make(config);
  const uint64_t fast = Join(), slow = Join();
  EXPECT_EQ(Request(slow).local_steps(), 50u);  // not measured yet: H
  v1::HeartbeatRequest hb;
  hb.set_worker_id(fast);
  hb.set_steps_per_second(4.0);
  ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  hb.set_worker_id(slow);
  hb.set_steps_per_second(1.52);  // 0.38 of the fastest
  ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  EXPECT_EQ(Request(fast).local_steps(), 50u);
  // slow still holds its first task; finish it, then its next one is shorter.
  const v1::Task first = Request(slow);
  PendingUpdate u = Update(slow, first, 0.1f);
  u.compute_seconds = 50 / 1.52;  // the push reports the same speed
  ASSERT_THAT(core_->SubmitUpdate(u), IsOk());
  EXPECT_EQ(Request(slow).local_steps(), 19u);  // floor(0.38 * 50)

  config.mutable_local_work()->set_mode(v1::LOCAL_WORK_TIME_BUDGET);
  config.mutable_local_work()->set_time_budget_seconds(2.5);
  Make(config);
  const v1::Task budgeted = Request(Join());
  EXPECT_DOUBLE_EQ(budgeted.time_budget_seconds(), 2.5);
  EXPECT_EQ(budgeted.local_steps(), 5000u);  // the cap: 100 x H
}

// DyLU behind a finite grace window keeps its workers in rounds (LocalWorkPlanner): the window
// of a slow worker that finished early (whole steps) waits for its round, and a joiner is
// planned to finish with the round. Speeds 1 and 0.38 steps/s, H = 20: P = 20 s.
TEST_F(AsyncServerCoreTest, AlignedDyLUKeepsWorkersInOneWindowAndAlignsAJoiner) {
  v1::ServerConfig config = AsyncConfig(0.5);
  config.set_local_steps(20);
  config.mutable_local_work()->set_mode(v1::LOCAL_WORK_DYLU);
  Make(config);
  const absl::Time t0 = clock_.Now();
  const uint64_t fast = Join(), slow = Join();
  auto report = [&](uint64_t worker, double speed) {
    v1::HeartbeatRequest hb;
    hb.set_worker_id(worker);
    hb.set_steps_per_second(speed);
    ASSERT_THAT(core_->Heartbeat(hb), IsOk());
  };
  auto push = [&](uint64_t worker, const v1::Task& task, double speed) {
    PendingUpdate u = Update(worker, task, 0.01f);
    u.compute_seconds = task.local_steps() / speed;  // the push reports the same speed
    return core_->SubmitUpdate(u);
  };
  report(fast, 1.0);
  report(slow, 0.38);
  const v1::Task tf = Request(fast), ts = Request(slow);
  EXPECT_EQ(tf.local_steps(), 20u);
  EXPECT_EQ(ts.local_steps(), 7u);  // Eq. 6: floor(0.38 * 20); done after 18.42 s
  // t = 18.42: slow is 1.58 s early, more than the 0.5 s grace; its window waits for the round.
  clock_.Advance(absl::Seconds(7 / 0.38));
  ASSERT_THAT(push(slow, ts, 0.38), IsOk());
  clock_.Advance(absl::Seconds(1.0));
  EXPECT_EQ(Request(slow).kind(), v1::Task::WAIT);  // a plain window would have closed
  // t = 20: fast arrives and the round is in: both start round 2 from version 2.
  clock_.Advance(absl::Seconds(20) - (clock_.Now() - t0));
  auto rf = push(fast, tf, 1.0);
  ASSERT_THAT(rf, IsOk());
  EXPECT_EQ(rf->staleness(), 1u);
  const v1::Task tf2 = Request(fast), ts2 = Request(slow);
  EXPECT_EQ(tf2.base_version(), 2u);
  EXPECT_EQ(ts2.base_version(), 2u);
  EXPECT_EQ(tf2.local_steps(), 20u);
  EXPECT_EQ(ts2.local_steps(), 7u);
  // t = 25: a worker measured at 0.5 steps/s joins; round 2 ends at t = 40, so it gets
  // floor(0.5 * 15) = 7 steps instead of Eq. 6's floor(0.5 * 20) = 10.
  clock_.Advance(absl::Seconds(5));
  const uint64_t late = Join();
  report(late, 0.5);
  EXPECT_EQ(Request(late).local_steps(), 7u);
  // An unmeasured joiner at t = 25 gets a time budget to t = 40 (H steps at most).
  const v1::Task unmeasured = Request(Join());
  EXPECT_EQ(unmeasured.local_steps(), 20u);
  EXPECT_DOUBLE_EQ(unmeasured.time_budget_seconds(), 15.0);
}

}  // namespace
}  // namespace aloe::server

namespace aloe::server {
namespace {

// Two cores given the same pushes stay bit-identical when one of them is rebuilt from a
// checkpoint halfway: parameters, Delayed Nesterov state, task ids/seeds, shard choice and LR
// positions all carry over.
TEST_F(ServerCoreTest, RestoredCoreContinuesBitIdentically) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_aggregation()->set_min_workers(1);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_DELAYED_NESTEROV);
  config.mutable_outer_optimizer()->set_momentum(0.9f);
  config.mutable_outer_optimizer()->set_dn_buffer_size(3);
  // (Penalty statistics are per worker id and workers join again after a restart, so only the
  // weights/clipping path, not anomaly decisions, can carry over exactly: warmup covers the run.)
  config.mutable_penalty()->set_enabled(true);
  config.mutable_penalty()->set_warmup(100);
  config.mutable_checkpoint()->set_dir("unused");
  config.mutable_checkpoint()->set_every_versions(4);
  auto round = [&](ServerCore& core, uint64_t worker, uint32_t seed) {
    v1::TaskRequest request;
    request.set_worker_id(worker);
    auto task = core.RequestTask(request);
    EXPECT_THAT(task, IsOk());
    EXPECT_THAT(core.SubmitUpdate(VariedUpdate(core.spec(), worker, *task, seed)), IsOk());
    return *task;
  };
  Make(config);
  const uint64_t a = Join();
  for (uint32_t r = 0; r < 5; ++r) round(*core_, a, r);
  std::vector<v1::ServerCheckpoint> taken = core_->TakeDueCheckpoints();
  ASSERT_EQ(taken.size(), 1u);  // captured right after version 4
  const v1::ServerCheckpoint* due = &taken[0];
  EXPECT_EQ(due->version(), 4u);
  EXPECT_TRUE(core_->TakeDueCheckpoints().empty());

  // Replay: the original core from version 5 and a restored one from version 4.
  FakeClock clock2;
  InlineExecutor executor2;
  RecordingMetrics metrics2;
  auto restored = ServerCore::Create(config, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                     "heldout.tok", clock2, executor2, metrics2);
  ASSERT_THAT(restored, IsOk());
  ASSERT_THAT((*restored)->RestoreCheckpoint(*due), IsOk());
  EXPECT_EQ((*restored)->version(), 4u);
  v1::JoinRequest join;
  join.set_name("w");
  auto b = (*restored)->Join(join);
  ASSERT_THAT(b, IsOk());
  EXPECT_GT(b->worker_id(), a);  // ids keep increasing across the restart
  // The restored core redoes round 5 (from version 4) with the same push the original got.
  round(**restored, b->worker_id(), 4);
  EXPECT_EQ((*restored)->version(), 5u);
  for (uint32_t r = 5; r < 9; ++r) {
    const v1::Task t1 = round(*core_, a, r);
    const v1::Task t2 = round(**restored, b->worker_id(), r);
    EXPECT_EQ(t1.task_id(), t2.task_id());
    EXPECT_EQ(t1.seed(), t2.seed());
    EXPECT_EQ(t1.shard_name(), t2.shard_name());
    EXPECT_EQ(t1.lr_step(), t2.lr_step());
  }
  auto params = [](const ServerCore& core) {
    std::vector<std::vector<float>> out;
    for (const auto& layer : core.Snapshot().layers) out.push_back(*layer);
    return out;
  };
  EXPECT_EQ(params(*core_), params(**restored));  // bit-identical
  EXPECT_EQ(core_->updates_applied(), (*restored)->updates_applied());

  // A checkpoint of another model is refused and changes nothing.
  v1::ServerConfig other = config;
  other.mutable_model()->set_d_model(16);
  FakeClock clock4;
  RecordingMetrics metrics4;
  auto mismatched = ServerCore::Create(other, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                       "heldout.tok", clock4, executor2, metrics4);
  ASSERT_THAT(mismatched, IsOk());
  EXPECT_THAT((*mismatched)->RestoreCheckpoint(*due),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another model")));
  EXPECT_EQ((*mismatched)->version(), 0u);
}

TEST_F(ServerCoreTest, AFinishedJobResumedWithHigherLimitsTrainsOn) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_aggregation()->set_min_workers(1);
  config.set_max_versions(2);
  Make(config);
  const uint64_t a = Join();
  for (int round = 0; round < 2; ++round) {
    const v1::Task t = Request(a);
    ASSERT_EQ(t.kind(), v1::Task::TRAIN);
    ASSERT_THAT(core_->SubmitUpdate(Update(a, t, 0.1f)), IsOk());
  }
  ASSERT_TRUE(core_->stopping());
  const v1::ServerCheckpoint finished = core_->CaptureCheckpoint();
  EXPECT_TRUE(finished.stopping());

  auto resume = [&](int64_t max_versions, FakeClock& clock, InlineExecutor& executor,
                    RecordingMetrics& metrics) {
    v1::ServerConfig c = config;
    c.set_max_versions(max_versions);
    auto core = ServerCore::Create(c, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}}, "heldout.tok",
                                   clock, executor, metrics);
    EXPECT_THAT(core, IsOk());
    EXPECT_THAT((*core)->RestoreCheckpoint(finished), IsOk());
    return *std::move(core);
  };
  FakeClock clock1, clock2;
  InlineExecutor executor;
  RecordingMetrics metrics1, metrics2;
  // The same limits: still over.
  EXPECT_TRUE(resume(2, clock1, executor, metrics1)->stopping());
  // Four versions: two more rounds, then over.
  auto more = resume(4, clock2, executor, metrics2);
  EXPECT_FALSE(more->stopping());
  v1::JoinRequest join;
  join.set_name("b");
  absl::StatusOr<v1::JoinReply> b = more->Join(join);
  ASSERT_THAT(b, IsOk());
  for (int round = 0; round < 2; ++round) {
    v1::TaskRequest request;
    request.set_worker_id(b->worker_id());
    absl::StatusOr<v1::Task> t = more->RequestTask(request);
    ASSERT_THAT(t, IsOk());
    ASSERT_EQ(t->kind(), v1::Task::TRAIN);
    ASSERT_THAT(more->SubmitUpdate(Update(b->worker_id(), *t, 0.1f)), IsOk());
  }
  EXPECT_EQ(more->version(), 4u);
  EXPECT_TRUE(more->stopping());
}

// --- Sharded across processes: the core is the coordinator and holds no parameters.

v1::PushHeader HeaderOf(uint64_t worker, const v1::Task& task, uint64_t update_id) {
  v1::PushHeader h;
  h.set_worker_id(worker);
  h.set_task_id(task.task_id());
  h.set_update_id(update_id);
  h.set_base_version(task.base_version());
  h.set_steps_done(task.local_steps());
  h.set_tokens_learned(100);
  return h;
}

// A shard's part of an update as a shard process delivers it: admitted first, then reported.
absl::StatusOr<v1::PushReply> Part(ServerCore& core, uint32_t shard, const v1::PushHeader& h) {
  absl::StatusOr<bool> admitted = core.AdmitPush(h);
  if (!admitted.ok()) return admitted.status();
  EXPECT_TRUE(*admitted) << "update " << h.update_id() << " of worker " << h.worker_id();
  return core.SubmitShardPart(shard, h);
}

TEST_F(ServerCoreTest, ShardedCoordinatorCommitsOnlyWhenEveryShardStagedItsPart) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(2);
  ASSERT_THAT(ValidateServerConfig(config), IsOk());
  Make(config);
  EXPECT_TRUE(core_->Snapshot().layers.empty());  // no parameters here
  v1::JoinRequest join;
  EXPECT_THAT(core_->Join(join),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("0 of 2 are following")));
  core_->SetShardAddress(0, "127.0.0.1:7001");
  EXPECT_THAT(core_->Join(join), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("1 of 2")));
  core_->SetShardAddress(1, "127.0.0.1:7002");
  auto joined = core_->Join(join);
  ASSERT_THAT(joined, IsOk());
  EXPECT_THAT(joined->shard_addresses(),
              ::testing::ElementsAre("127.0.0.1:7001", "127.0.0.1:7002"));
  const uint64_t a = joined->worker_id();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_EQ(ta.kind(), v1::Task::TRAIN);

  // a: both parts in; b: only shard 1's part so far. Sync (min 2): nothing committed yet.
  auto first = Part(*core_, 0, HeaderOf(a, ta, 11));
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->staged());
  EXPECT_EQ(first->slices_received(), 1u);
  EXPECT_THAT(Part(*core_, 1, HeaderOf(a, ta, 11)), IsOk());
  EXPECT_THAT(Part(*core_, 1, HeaderOf(b, tb, 21)), IsOk());
  EXPECT_TRUE(core_->shard_log()->orders().empty());
  EXPECT_EQ(core_->version(), 0u);
  // A shard index out of range, or a part of an update with no open task, is refused.
  EXPECT_THAT(Part(*core_, 2, HeaderOf(b, tb, 21)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 shard processes")));
  EXPECT_THAT(Part(*core_, 0, HeaderOf(a, ta, 11)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no open training task")));
  // b's last part completes the round: one COMMIT of version 1, the plain mean of two updates.
  auto last = Part(*core_, 0, HeaderOf(b, tb, 21));
  ASSERT_THAT(last, IsOk());
  EXPECT_FALSE(last->staged());
  EXPECT_TRUE(last->applied());
  EXPECT_EQ(core_->version(), 1u);
  ASSERT_EQ(core_->shard_log()->orders().size(), 1u);
  const v1::ShardOrder& commit = core_->shard_log()->orders()[0];
  EXPECT_EQ(commit.kind(), v1::ShardOrder::COMMIT);
  EXPECT_EQ(commit.version(), 1u);
  ASSERT_EQ(commit.entries_size(), 2);
  EXPECT_EQ(commit.entries(0).worker_id(), a);
  EXPECT_EQ(commit.entries(0).update_id(), 11u);
  EXPECT_FLOAT_EQ(commit.entries(0).weight(), 0.5f);
  EXPECT_EQ(commit.entries(1).update_id(), 21u);
  EXPECT_FLOAT_EQ(commit.entries(1).weight(), 0.5f);
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(0), std::optional<size_t>(0));
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(1), std::optional<size_t>(1));
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(2), std::nullopt);

  // A worker that leaves with a part staged on one shard: the shards are told to drop it.
  const v1::Task ta2 = Request(a);
  ASSERT_EQ(ta2.kind(), v1::Task::TRAIN);
  ASSERT_THAT(Part(*core_, 1, HeaderOf(a, ta2, 12)), IsOk());
  v1::LeaveRequest leave;
  leave.set_worker_id(a);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  ASSERT_EQ(core_->shard_log()->orders().size(), 2u);
  EXPECT_EQ(core_->shard_log()->orders()[1].kind(), v1::ShardOrder::DISCARD);
  EXPECT_EQ(core_->shard_log()->orders()[1].entries(0).worker_id(), a);
  EXPECT_EQ(core_->shard_log()->orders()[1].entries(0).update_id(), 12u);
  EXPECT_EQ(core_->version(), 1u);
}

// A sharded coordinator answers the part that completes an update with the next task (the shard
// relays it to the worker); the parts before it are staged replies without one.
TEST_F(ServerCoreTest, ShardedCoordinatorAnswersTheLastPartWithTheNextTask) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(2);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  ASSERT_THAT(ValidateServerConfig(config), IsOk());
  Make(config);
  core_->SetShardAddress(0, "127.0.0.1:7001");
  core_->SetShardAddress(1, "127.0.0.1:7002");
  const uint64_t a = Join();
  const v1::Task ta = Request(a);
  v1::PushHeader header = HeaderOf(a, ta, 1);
  header.set_want_next_task(true);
  auto first = Part(*core_, 1, header);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->staged());
  EXPECT_FALSE(first->has_next_task());
  auto last = Part(*core_, 0, header);
  ASSERT_THAT(last, IsOk());
  EXPECT_TRUE(last->applied());
  ASSERT_TRUE(last->has_next_task());
  EXPECT_EQ(last->next_task().kind(), v1::Task::TRAIN);
  EXPECT_EQ(last->next_task().base_version(), 1u);
  EXPECT_EQ(Request(a).task_id(), last->next_task().task_id());
  // The COMMIT of version 1 went out before the task from it.
  ASSERT_EQ(core_->shard_log()->orders().size(), 1u);
  EXPECT_EQ(core_->shard_log()->orders()[0].version(), 1u);
}

TEST_F(ServerCoreTest, ShardedStalenessDiscountTravelsInTheCommitWeight) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(1);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  config.mutable_outer_optimizer()->set_staleness_exponent(1.0f);
  Make(config);
  core_->SetShardAddress(0, "s0");
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  ASSERT_THAT(Part(*core_, 0, HeaderOf(a, ta, 1)), IsOk());  // staleness 0
  ASSERT_THAT(Part(*core_, 0, HeaderOf(b, tb, 1)), IsOk());  // staleness 1
  ASSERT_EQ(core_->shard_log()->orders().size(), 2u);
  EXPECT_FLOAT_EQ(core_->shard_log()->orders()[0].entries(0).weight(), 1.0f);
  EXPECT_FLOAT_EQ(core_->shard_log()->orders()[1].entries(0).weight(), 0.5f);  // (1 + 1)^-1
}

// The order log drops what every shard received, in batches, keeping absolute indices: a shard
// at a version whose COMMIT is still held continues after it; one before the trimmed part cannot.
TEST_F(ServerCoreTest, ShardedOrderLogTrimsInBatchesWithStableIndices) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(1);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  Make(config);
  core_->SetShardAddress(0, "s0");
  const uint64_t a = Join();
  const uint64_t n = ShardCommitLog::kOrderTrimBatch + 100;
  for (uint64_t round = 0; round < n; ++round) {
    ASSERT_THAT(Part(*core_, 0, HeaderOf(a, Request(a), round + 1)), IsOk());
  }
  ASSERT_EQ(core_->shard_log()->orders().size(), n);  // one COMMIT per version
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(0), std::optional<uint64_t>(0));
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(10), std::optional<uint64_t>(10));

  core_->shard_log()->TrimOrdersBefore(ShardCommitLog::kOrderTrimBatch -
                                       1);  // less than a batch: kept
  EXPECT_EQ(core_->shard_log()->first_order_index(), 0u);
  core_->shard_log()->TrimOrdersBefore(ShardCommitLog::kOrderTrimBatch + 50);
  EXPECT_EQ(core_->shard_log()->first_order_index(), ShardCommitLog::kOrderTrimBatch + 50);
  EXPECT_EQ(core_->shard_log()->orders().size(), 50u);
  EXPECT_EQ(core_->shard_log()->orders().front().version(), ShardCommitLog::kOrderTrimBatch + 51);
  // Version kOrderTrimBatch + 50's COMMIT is gone, but a shard there continues at the front.
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(ShardCommitLog::kOrderTrimBatch + 50),
            std::optional<uint64_t>(ShardCommitLog::kOrderTrimBatch + 50));
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(ShardCommitLog::kOrderTrimBatch + 60),
            std::optional<uint64_t>(ShardCommitLog::kOrderTrimBatch + 60));
  EXPECT_EQ(core_->shard_log()->OrderIndexAfter(10), std::nullopt);
}

v1::HeartbeatRequest PulledBeat(uint64_t worker, uint64_t task_id, uint32_t slice = 0,
                                uint32_t slices = 0) {
  v1::HeartbeatRequest beat;
  beat.set_worker_id(worker);
  beat.set_pulled_task_id(task_id);
  beat.set_pulled_slice(slice);
  beat.set_pulled_slices(slices);
  return beat;
}

// Async: a task's base version is kept only until its worker says it holds it (all slices), not
// for the whole round; the task itself stays open and its push is applied with its staleness.
TEST_F(AsyncServerCoreTest, BaseVersionIsKeptOnlyUntilTheWorkerHasPulledIt) {
  Make(AsyncConfig(/*grace_seconds=*/0));
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);  // base 0, pulled in 2 slices (a two-rank node)
  const v1::Task tb = Request(b);  // base 0
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)), IsOk());   // version 1
  const v1::Task tb2 = Request(b);                                 // base 1
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb2, 1.0f)), IsOk());  // version 2
  const v1::Task tb3 = Request(b);                                 // base 2, open
  EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0, 2));       // 1's only task has ended

  // A bad slice is refused and changes nothing; an unknown or answered task is ignored.
  EXPECT_THAT(core_->Heartbeat(PulledBeat(a, ta.task_id(), 2, 2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slice 2 of 2")));
  ASSERT_THAT(core_->Heartbeat(PulledBeat(a, ta.task_id() + 100)), IsOk());
  ASSERT_THAT(core_->Heartbeat(PulledBeat(b, tb.task_id())), IsOk());
  ASSERT_THAT(core_->Heartbeat(PulledBeat(b, ta.task_id())), IsOk());  // a's task, not b's
  EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0, 2));

  ASSERT_THAT(core_->Heartbeat(PulledBeat(a, ta.task_id(), 1, 2)), IsOk());
  EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0, 2));  // slice 0 still out
  ASSERT_THAT(core_->Heartbeat(PulledBeat(a, ta.task_id(), 0, 2)), IsOk());
  EXPECT_THAT(core_->RetainedVersions(), ElementsAre(2));  // b's task from 2 has not pulled
  ASSERT_THAT(core_->Heartbeat(PulledBeat(b, tb3.task_id())), IsOk());
  EXPECT_THAT(core_->RetainedVersions(), ElementsAre());

  // Version 0 is gone for pulls, but a's push from it is still applied (staleness 2).
  v1::PullRequest pull;
  pull.set_worker_id(a);
  pull.set_version(0);
  EXPECT_THAT(core_->SnapshotFor(pull),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not available")));
  auto applied = core_->SubmitUpdate(Update(a, ta, 1.0f));
  ASSERT_THAT(applied, IsOk());
  EXPECT_EQ(applied->version(), 3u);
}

// A worker that cannot run its task (its base version is gone) gives it up by name: the server
// ends it (tokens back to the data shard, its base no longer kept) and hands out a new task from
// the current version; a plain repeated request, or one naming another task, gets the same task.
TEST_F(AsyncServerCoreTest, ATaskGivenUpIsEndedAndANewOneHandedOut) {
  const v1::ServerConfig config = AsyncConfig(/*grace_seconds=*/0);
  Make(config);
  const uint64_t a = Join();
  const uint64_t b = Join();
  const v1::Task ta = Request(a);  // base 0, never pulled
  const v1::Task tb = Request(b);
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)), IsOk());    // version 1
  EXPECT_THAT(core_->RetainedVersions(), ::testing::Contains(0u));  // kept for ta
  uint64_t in_flight = 0;
  for (size_t i = 0; i < 2; ++i) in_flight += core_->sampler().tokens_in_flight(i);
  EXPECT_GT(in_flight, 0u);  // a's task

  v1::TaskRequest again;
  again.set_worker_id(a);
  EXPECT_EQ(core_->RequestTask(again)->task_id(), ta.task_id());  // a lost reply: the same task
  again.set_dropped_task_id(ta.task_id() + 1000);                 // not a's open task: ignored
  EXPECT_EQ(core_->RequestTask(again)->task_id(), ta.task_id());
  EXPECT_THAT(core_->RetainedVersions(), ::testing::Contains(0u));

  again.set_dropped_task_id(ta.task_id());
  absl::StatusOr<v1::Task> fresh = core_->RequestTask(again);
  ASSERT_THAT(fresh, IsOk());
  EXPECT_EQ(fresh->kind(), v1::Task::TRAIN);
  EXPECT_NE(fresh->task_id(), ta.task_id());
  EXPECT_EQ(fresh->base_version(), 1u);
  EXPECT_THAT(core_->RetainedVersions(), ElementsAre(1));  // version 0 was kept only for ta
  // Asked again with the same id (a retry whose answer was lost): the new task, not another.
  EXPECT_EQ(core_->RequestTask(again)->task_id(), fresh->task_id());
  // Only the new task's tokens are in flight; the given-up task's went back.
  uint64_t now_in_flight = 0;
  for (size_t i = 0; i < 2; ++i) now_in_flight += core_->sampler().tokens_in_flight(i);
  EXPECT_EQ(now_in_flight, static_cast<uint64_t>(fresh->local_steps()) *
                               config.inner_optimizer().batch_size() * (config.model().seq_len()));
  // The given-up task's update is refused; the new one's is applied.
  EXPECT_FALSE(core_->SubmitUpdate(Update(a, ta, 1.0f)).ok());
  auto applied = core_->SubmitUpdate(Update(a, *fresh, 1.0f));
  ASSERT_THAT(applied, IsOk());
  EXPECT_EQ(applied->version(), 2u);
}

// Plain async (tau_grace = 0): a worker that pushed starts its next task from the newest version
// when it asks, not from the version its own push made, and nothing holds that version for it
// meanwhile. With a grace window the released workers share the version of the close.
TEST_F(AsyncServerCoreTest, PlainAsyncStartsAReleasedWorkerFromTheNewestVersion) {
  for (const double grace : {0.0, 100.0}) {
    SCOPED_TRACE(grace);
    Make(AsyncConfig(grace));
    const uint64_t a = Join(), b = Join();
    const v1::Task ta = Request(a);
    const v1::Task tb = Request(b);
    ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)), IsOk());  // version 1
    if (grace > 0) {
      EXPECT_EQ(Request(a).kind(), v1::Task::WAIT);                   // b may still join the window
      ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)), IsOk());  // version 2, both released
      EXPECT_THAT(core_->RetainedVersions(), ElementsAre(2));
      const v1::Task tb2 = Request(b);
      ASSERT_THAT(core_->SubmitUpdate(Update(b, tb2, 1.0f)), IsOk());  // version 3 (b alone)
      EXPECT_EQ(Request(a).base_version(), 2u);  // the version the window closed at
      continue;
    }
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0));         // tb's base, not pulled
    ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)), IsOk());  // version 2
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre());
    EXPECT_EQ(Request(a).base_version(), 2u);
    EXPECT_EQ(Request(b).base_version(), 2u);
  }
}

// PushHeader.want_next_task: the reply of the push that completes an update carries the task a
// RequestTask right after it would get (now the worker's open task), unless that is WAIT; a push
// that does not ask, or a slice that does not complete the update, gets none.
TEST_F(AsyncServerCoreTest, APushThatAsksGetsItsNextTaskInTheReply) {
  v1::ServerConfig config = AsyncConfig(0);
  config.set_max_versions(3);
  Make(config);
  const uint64_t a = Join(), b = Join();
  const v1::Task ta = Request(a);
  const v1::Task tb = Request(b);
  auto ra = core_->SubmitUpdate(Update(a, ta, 1.0f));  // version 1, not asked
  ASSERT_THAT(ra, IsOk());
  EXPECT_FALSE(ra->has_next_task());
  PendingUpdate ub = Update(b, tb, 1.0f);
  ub.want_next_task = true;
  auto rb = core_->SubmitUpdate(std::move(ub));  // version 2
  ASSERT_THAT(rb, IsOk());
  ASSERT_TRUE(rb->has_next_task());
  const v1::Task next = rb->next_task();
  EXPECT_EQ(next.kind(), v1::Task::TRAIN);
  EXPECT_EQ(next.base_version(), 2u);
  EXPECT_GT(next.task_id(), tb.task_id());
  EXPECT_EQ(next.local_steps(), 5u);
  EXPECT_EQ(Request(b).task_id(), next.task_id());  // it is b's open task
  EXPECT_EQ(metrics_.Value("aloe_tasks_in_push_replies_total"), 1);
  // The last version: a's next task would be STOP, and the reply carries it.
  const v1::Task ta2 = Request(a);
  ASSERT_EQ(ta2.kind(), v1::Task::TRAIN);
  PendingUpdate ua = Update(a, ta2, 1.0f);
  ua.want_next_task = true;
  ra = core_->SubmitUpdate(std::move(ua));  // version 3 = max_versions
  ASSERT_THAT(ra, IsOk());
  ASSERT_TRUE(ra->has_next_task());
  EXPECT_EQ(ra->next_task().kind(), v1::Task::STOP);
  EXPECT_EQ(metrics_.Value("aloe_tasks_in_push_replies_total"), 2);

  // Sync (min_workers 2): the first push of a round would get WAIT, so its reply carries no
  // task; the push that completes the round gets its next task from the new version.
  Make(TinyConfig());
  const uint64_t c = Join(), d = Join();
  const v1::Task tc = Request(c);
  const v1::Task td = Request(d);
  PendingUpdate uc = Update(c, tc, 1.0f);
  uc.want_next_task = true;
  auto rc = core_->SubmitUpdate(std::move(uc));
  ASSERT_THAT(rc, IsOk());
  EXPECT_FALSE(rc->applied());
  EXPECT_FALSE(rc->has_next_task());
  PendingUpdate ud = Update(d, td, 3.0f);
  ud.want_next_task = true;
  auto rd = core_->SubmitUpdate(std::move(ud));
  ASSERT_THAT(rd, IsOk());
  EXPECT_TRUE(rd->applied());
  ASSERT_TRUE(rd->has_next_task());
  EXPECT_EQ(rd->next_task().kind(), v1::Task::TRAIN);
  EXPECT_EQ(rd->next_task().base_version(), 1u);
  EXPECT_EQ(Request(c).base_version(), 1u);  // c asks as usual

  // Sliced: only the slice that completes the update answers, and only if it asked.
  for (const bool last_asks : {true, false}) {
    SCOPED_TRACE(last_asks);
    Make(AsyncConfig(0));
    const uint64_t e = Join();
    const v1::Task te = Request(e);
    auto slice = [&](uint32_t i, bool ask) {
      PendingUpdate u = Update(e, te, 1.0f);
      u.slice = i;
      u.slices = 2;
      u.want_next_task = ask;
      return core_->SubmitUpdate(std::move(u));
    };
    auto first = slice(0, true);
    ASSERT_THAT(first, IsOk());
    EXPECT_TRUE(first->staged());
    EXPECT_FALSE(first->has_next_task());
    auto second = slice(1, last_asks);
    ASSERT_THAT(second, IsOk());
    EXPECT_FALSE(second->staged());
    EXPECT_EQ(second->has_next_task(), last_asks);
  }
}

// max_retained_versions (default 1): an outer step that would hold one more older version does
// not hold the version it replaces when only training tasks that have not pulled it start from
// it. A version held already stays (a slow pull is never cut off by newer ones); a task whose
// base is gone finds it so at its pull and is given up and replaced. An evaluation's version is
// held whatever the cap says.
TEST_F(AsyncServerCoreTest, AtMostMaxRetainedVersionsOlderVersionsAreHeld) {
  for (const uint32_t cap : {1u, 2u}) {
    SCOPED_TRACE(cap);
    // The metrics outlive the cores: counted from here.
    const double dropped0 = metrics_.Value("aloe_retained_versions_dropped_total");
    auto dropped = [&] {
      return metrics_.Value("aloe_retained_versions_dropped_total") - dropped0;
    };
    const double copied0 = metrics_.Value("aloe_layer_steps_copied_total");
    auto copied = [&] { return metrics_.Value("aloe_layer_steps_copied_total") - copied0; };
    v1::ServerConfig config = AsyncConfig(/*grace_seconds=*/0);
    config.set_eval_every(1000);  // the evaluator below gets version 0 only
    config.set_max_retained_versions(cap);
    Make(config);
    const uint64_t a = Join(), b = Join(), c = Join();
    auto pull = [&](uint64_t worker, uint64_t version) {
      v1::PullRequest request;
      request.set_worker_id(worker);
      request.set_version(version);
      return core_->SnapshotFor(request);
    };
    const v1::Task ta = Request(a);  // base 0: a slow pull
    const v1::Task tb = Request(b);
    const std::vector<std::vector<float>> v0 = Params();
    ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 1.0f)), IsOk());  // version 1; 0 held for ta
    const v1::Task tc = Request(c);                                 // base 1, not pulled yet
    const v1::Task tb2 = Request(b);                                // base 1
    ASSERT_EQ(tc.base_version(), 1u);
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0, 1));
    const double layers = core_->spec().layers_size();
    EXPECT_EQ(copied(), layers);  // version 0 was held: every layer stepped into a fresh buffer
    ASSERT_THAT(core_->SubmitUpdate(Update(b, tb2, 1.0f)), IsOk());  // version 2
    if (cap == 2) {
      EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0, 1));
      EXPECT_EQ(dropped(), 0);
      EXPECT_EQ(copied(), 2 * layers);
      EXPECT_THAT(pull(c, 1), IsOk());
      continue;
    }
    // Holding 1 as well would make two older versions: 1 is not held, 0 stays.
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0));
    EXPECT_EQ(dropped(), 1);
    EXPECT_EQ(copied(), layers);  // version 1's buffers were updated in place
    absl::StatusOr<ModelSnapshot> slow = pull(a, 0);
    ASSERT_THAT(slow, IsOk());
    for (size_t l = 0; l < v0.size(); ++l) EXPECT_EQ(*slow->layers[l], v0[l]) << "layer " << l;
    EXPECT_THAT(pull(c, 1),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not available")));
    // c gives its task up and gets one from version 2.
    v1::TaskRequest give_up;
    give_up.set_worker_id(c);
    give_up.set_dropped_task_id(tc.task_id());
    absl::StatusOr<v1::Task> fresh = core_->RequestTask(give_up);
    ASSERT_THAT(fresh, IsOk());
    EXPECT_EQ(fresh->base_version(), 2u);
    EXPECT_EQ(metrics_.Value("aloe_tasks_given_up_total"), 1);
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre(0, 2));
    // The slow task goes on: its push is applied (staleness 2), and 2 is then held for c as
    // the one older version.
    ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 1.0f)), IsOk());  // version 3
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre(2));
    EXPECT_THAT(pull(c, 2), IsOk());

    // An evaluation's version is held even with the cap reached.
    const uint64_t e = Join(v1::ROLE_EVALUATOR);
    const v1::Task eval = Request(e);
    ASSERT_EQ(eval.kind(), v1::Task::EVAL);
    EXPECT_EQ(eval.base_version(), 3u);
    const v1::Task ta2 = Request(a);                                 // base 3
    ASSERT_THAT(core_->SubmitUpdate(Update(a, ta2, 1.0f)), IsOk());  // version 4
    EXPECT_THAT(core_->RetainedVersions(), ElementsAre(2, 3));
    EXPECT_THAT(pull(e, 3), IsOk());
    EXPECT_EQ(dropped(), 1);
  }
}

// A core that replaces another (a coordinator going back to a checkpoint) never hands out an id
// the old one did: a worker of the old core gets NOT_FOUND instead of acting as a new joiner.
TEST_F(ServerCoreTest, ReplacementContinuesWorkerAndTaskIds) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_aggregation()->set_min_workers(1);
  Make(config);
  const uint64_t old_worker = Join();
  const v1::Task old_task = Request(old_worker);
  std::unique_ptr<ServerCore> old_core = std::move(core_);
  Make(config);
  core_->ContinueIdsOf(*old_core);
  const uint64_t new_worker = Join();
  EXPECT_GT(new_worker, old_worker);
  EXPECT_GT(Request(new_worker).task_id(), old_task.task_id());
  v1::TaskRequest request;
  request.set_worker_id(old_worker);
  EXPECT_THAT(core_->RequestTask(request), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// At most max_staged_updates updates are admitted at once (the same on every shard); an
// admission ends with the update's COMMIT or DISCARD, a newer update of its worker, or its
// worker leaving; an update that was not admitted cannot be reported.
TEST_F(ServerCoreTest, ShardedAdmissionIsBoundedAndEndsWithTheUpdate) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(2);
  config.set_max_staged_updates(2);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  Make(config);
  core_->SetShardAddress(0, "s0");
  core_->SetShardAddress(1, "s1");
  const uint64_t a = Join(), b = Join(), c = Join();
  const v1::Task ta = Request(a), tb = Request(b), tc = Request(c);
  auto admit = [&](const v1::PushHeader& h) {
    absl::StatusOr<bool> admitted = core_->AdmitPush(h);
    EXPECT_THAT(admitted, IsOk());
    return admitted.ok() && *admitted;
  };
  EXPECT_TRUE(admit(HeaderOf(a, ta, 1)));
  EXPECT_TRUE(admit(HeaderOf(a, ta, 1)));  // a retry
  EXPECT_TRUE(admit(HeaderOf(b, tb, 1)));
  EXPECT_FALSE(admit(HeaderOf(c, tc, 1)));  // 2 of 2
  EXPECT_THAT(core_->SubmitShardPart(0, HeaderOf(c, tc, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not admitted")));
  // a's update reaches both shards and commits: its admission ends, c gets one.
  ASSERT_THAT(core_->SubmitShardPart(0, HeaderOf(a, ta, 1)), IsOk());
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 2u);  // on one shard only: still admitted
  ASSERT_THAT(core_->SubmitShardPart(1, HeaderOf(a, ta, 1)), IsOk());
  EXPECT_EQ(core_->version(), 1u);
  EXPECT_TRUE(admit(HeaderOf(c, tc, 1)));
  // b gives up its update for a newer one: the old one's part is discarded, the new admitted.
  ASSERT_THAT(core_->SubmitShardPart(0, HeaderOf(b, tb, 1)), IsOk());
  EXPECT_TRUE(admit(HeaderOf(b, tb, 2)));
  EXPECT_EQ(core_->shard_log()->orders().back().kind(), v1::ShardOrder::DISCARD);
  EXPECT_EQ(core_->shard_log()->orders().back().entries(0).update_id(), 1u);
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 2u);  // c's and b's second
  // c leaves: its admission ends.
  v1::LeaveRequest leave;
  leave.set_worker_id(c);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 1u);
  // A stale push (no open task) is refused at admission.
  EXPECT_FALSE(core_->AdmitPush(HeaderOf(a, ta, 7)).ok());
}

// The only shard process (shard_processes 1) does not ask AdmitPush: its report admits the
// update. The bound still holds: beyond max_staged_updates the report is refused
// (RESOURCE_EXHAUSTED) and changes nothing; a stale report is refused as at admission.
TEST_F(ServerCoreTest, TheOnlyShardProcessIsAdmittedByItsReport) {
  // One slot, held by a's admission: b's report cannot be admitted.
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(1);
  config.set_max_staged_updates(1);
  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  Make(config);
  core_->SetShardAddress(0, "s0");
  const uint64_t a = Join(), b = Join();
  const v1::Task ta = Request(a), tb = Request(b);
  ASSERT_THAT(core_->AdmitPush(HeaderOf(a, ta, 1)), IsOk());
  EXPECT_THAT(core_->SubmitShardPart(0, HeaderOf(b, tb, 1)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_staged_updates")));
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 1u);
  EXPECT_TRUE(core_->shard_log()->orders().empty());
  EXPECT_EQ(Request(b).task_id(), tb.task_id());  // b's task is still open
  auto ra = core_->SubmitShardPart(0, HeaderOf(a, ta, 1));
  ASSERT_THAT(ra, IsOk());
  EXPECT_FALSE(ra->staged());  // the only part: the whole update
  EXPECT_TRUE(ra->applied());
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 0u);  // ended by the COMMIT
  // b's report now admits b's update itself.
  auto rb = core_->SubmitShardPart(0, HeaderOf(b, tb, 1));
  ASSERT_THAT(rb, IsOk());
  EXPECT_TRUE(rb->applied());
  EXPECT_EQ(core_->version(), 2u);

  config = TinyConfig();  // sync, min_workers 2
  config.set_shard_processes(1);
  config.set_max_staged_updates(2);
  Make(config);
  core_->SetShardAddress(0, "s0");
  const uint64_t c = Join(), d = Join();
  const v1::Task tc = Request(c), td = Request(d);
  ASSERT_THAT(core_->SubmitShardPart(0, HeaderOf(c, tc, 1)), IsOk());
  auto rd = core_->SubmitShardPart(0, HeaderOf(d, td, 1));
  ASSERT_THAT(rd, IsOk());
  EXPECT_TRUE(rd->applied());
  EXPECT_EQ(core_->version(), 1u);
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 0u);  // ended by the COMMIT
  ASSERT_EQ(core_->shard_log()->orders().size(), 1u);
  EXPECT_EQ(core_->shard_log()->orders()[0].entries_size(), 2);
  // A retry of a committed update finds no open task: refused, nothing admitted.
  EXPECT_THAT(core_->SubmitShardPart(0, HeaderOf(c, tc, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no open training task")));
  EXPECT_EQ(core_->shard_log()->admitted_updates(), 0u);
}

// A sync round of a layer-sharded server commits only once every trainer's update is staged on
// every shard at once: a trainer beyond max_staged_updates is refused at Join (it would stop
// every round) with a message naming the limit; evaluators are not limited, and a trainer may
// join once another has left. Async servers and single-process servers have no such limit.
TEST_F(ServerCoreTest, AShardedSyncServerTakesNoMoreTrainersThanStagingSlots) {
  v1::ServerConfig config = TinyConfig();  // sync, min_workers 2
  config.set_shard_processes(2);
  config.set_max_staged_updates(2);
  Make(config);
  core_->SetShardAddress(0, "s0");
  core_->SetShardAddress(1, "s1");
  const uint64_t a = Join();
  Join();
  v1::JoinRequest third;
  third.set_name("third");
  third.set_role(v1::ROLE_TRAINER);
  EXPECT_THAT(core_->Join(third),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("has 2 trainers, as many as max_staged_updates (2)"),
                             HasSubstr("would stop every round"))));
  EXPECT_EQ(metrics_.Value("aloe_workers_joined_total"), 2);  // the refusal changed nothing
  Join(v1::ROLE_EVALUATOR);
  Join(v1::ROLE_OBSERVER);  // neither trains
  v1::LeaveRequest leave;
  leave.set_worker_id(a);
  ASSERT_THAT(core_->Leave(leave), IsOk());
  EXPECT_THAT(core_->Join(third), IsOk());

  config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
  config.mutable_aggregation()->set_min_workers(1);
  Make(config);
  core_->SetShardAddress(0, "s0");
  core_->SetShardAddress(1, "s1");
  for (int i = 0; i < 3; ++i) Join();
  config = TinyConfig();
  config.set_max_staged_updates(2);
  Make(config);
  for (int i = 0; i < 3; ++i) Join();
}

// A restarted process skips the worker ids its predecessor may have handed out after the
// checkpoint: a worker of the dead process comes back with such an id and must get NOT_FOUND.
TEST_F(ServerCoreTest, RestartedProcessSkipsWorkerIdsOfTheLostOne) {
  v1::ServerConfig config = TinyConfig();
  config.mutable_aggregation()->set_min_workers(1);
  Make(config);
  Join();
  const v1::ServerCheckpoint checkpoint = core_->CaptureCheckpoint();
  const uint64_t after_checkpoint = Join();  // the dead process handed this one out
  Make(config);
  ASSERT_THAT(core_->RestoreCheckpoint(checkpoint), IsOk());
  core_->SkipWorkerIdsOfLostProcess();
  const uint64_t joiner = Join();
  EXPECT_EQ(joiner, after_checkpoint + ServerCore::kWorkerIdGapAfterRestart);
  v1::TaskRequest request;
  request.set_worker_id(after_checkpoint);
  EXPECT_THAT(core_->RequestTask(request), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// A coordinator keeps every due checkpoint (a restarted shard can only go back to a version the
// coordinator checkpointed too); a single-process core only the newest.
TEST_F(ServerCoreTest, ShardedCoordinatorKeepsEveryDueCheckpoint) {
  for (uint32_t processes : {1u, 0u}) {
    v1::ServerConfig config = TinyConfig();
    config.set_shard_processes(processes);
    config.mutable_aggregation()->set_mode(v1::AGGREGATION_ASYNC);
    config.mutable_aggregation()->set_min_workers(1);
    config.mutable_checkpoint()->set_dir("unused");
    config.mutable_checkpoint()->set_every_versions(2);
    Make(config);
    if (processes > 0) core_->SetShardAddress(0, "s0");
    const uint64_t a = Join();
    for (uint32_t round = 0; round < 5; ++round) {
      const v1::Task task = Request(a);
      if (processes > 0) {
        ASSERT_THAT(Part(*core_, 0, HeaderOf(a, task, round + 1)), IsOk());
      } else {
        ASSERT_THAT(core_->SubmitUpdate(VariedUpdate(core_->spec(), a, task, round)), IsOk());
      }
    }
    std::vector<uint64_t> versions;
    for (const v1::ServerCheckpoint& c : core_->TakeDueCheckpoints())
      versions.push_back(c.version());
    const std::vector<uint64_t> expected =
        processes > 0 ? std::vector<uint64_t>{2, 4} : std::vector<uint64_t>{4};
    EXPECT_EQ(versions, expected) << processes << " shard processes";
    EXPECT_TRUE(core_->TakeDueCheckpoints().empty());
  }
}

TEST(ShardAssemblyTest, ChoosesTheNewestVersionEveryProcessCanReach) {
  // Coordinator at 17 with checkpoints 10 and 15; shard 0 alive at 17 with checkpoints 10 and
  // 15; shard 1 restarted from its checkpoint 15 (checkpoints 10, 15): everybody can be at 15.
  EXPECT_EQ(ChooseCommonVersion({17, 15, 10}, {{17, {15, 10}}, {15, {15, 10}}}), 15u);
  // Shard 1 lost checkpoint 15: back to 10.
  EXPECT_EQ(ChooseCommonVersion({17, 15, 10}, {{17, {15, 10}}, {10, {10}}}), 10u);
  // Everybody at the same version (a start): stay.
  EXPECT_EQ(ChooseCommonVersion({6}, {{6, {}}, {6, {}}}), 6u);
  // Nothing in common: the initial model.
  EXPECT_EQ(ChooseCommonVersion({8}, {{8, {}}, {3, {}}}), 0u);
  // The coordinator resumed from 10 while the shards ran on to 12: 10.
  EXPECT_EQ(ChooseCommonVersion({10, 10, 5}, {{12, {10, 5}}, {12, {10, 5}}}), 10u);
}

TEST(ShardAssemblyTest, FingerprintNamesLayoutOptimizerAndProcesses) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(2);
  v1::ModelSpec spec;
  auto* l0 = spec.add_layers();
  l0->set_name("embed");
  l0->set_num_elements(12);
  l0->set_shard(1);
  EXPECT_EQ(ShardedModelFingerprint(config, spec, ""),
            "sharded1;outer=OUTER_SGD/N=1;processes=2;embed:12@1;");
  EXPECT_EQ(ShardedModelFingerprint(config, spec, "byo1-x"),
            "sharded1;outer=OUTER_SGD/N=1;processes=2;embed:12@1;model=byo1-x");
}

constexpr char kExceed[] = "exceed outer_optimizer.dn_buffer_size 3";
constexpr char kWithin[] = "within outer_optimizer.dn_buffer_size 3 again";

size_t Count(const std::string& log, const std::string& what) {
  size_t n = 0;
  for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
  return n;
}

// ServerCore's check of Delayed Nesterov's buffer against the trainers: the
// aloe_config_unstable{reason="dn_buffer_below_trainers"} gauge and the log lines, once per
// crossing of the live trainers above dn_buffer_size in async mode.
class DnBufferCheckTest : public ServerCoreTest {
 protected:
  // Delayed Nesterov with N = 3, lr 0.7, as an operator would write it; async with a grace
  // window of 0.5 s.
  static v1::ServerConfig DnConfig(v1::AggregationMode mode, uint32_t min_workers) {
    v1::ServerConfig config = TinyConfig();
    config.set_lease_seconds(10);
    config.mutable_aggregation()->set_mode(mode);
    config.mutable_aggregation()->set_min_workers(min_workers);
    if (mode == v1::AGGREGATION_ASYNC) config.mutable_aggregation()->set_grace_seconds(0.5);
    config.mutable_outer_optimizer()->set_type(v1::OUTER_DELAYED_NESTEROV);
    config.mutable_outer_optimizer()->set_lr(0.7f);
    config.mutable_outer_optimizer()->set_momentum(0.9f);
    config.mutable_outer_optimizer()->set_dn_buffer_size(3);
    EXPECT_THAT(ValidateServerConfig(config), IsOk());
    return config;
  }

  void Leave(uint64_t worker) {
    v1::LeaveRequest request;
    request.set_worker_id(worker);
    ASSERT_THAT(core_->Leave(request), IsOk());
  }

  double Unstable() const { return metrics_.Value(kConfigUnstable, {kDnBufferBelowTrainers}); }
};

TEST_F(DnBufferCheckTest, GaugeAndWarningFollowEachCrossingAboveTheBuffer) {
  ::testing::internal::CaptureStderr();
  Make(DnConfig(v1::AGGREGATION_ASYNC, 1));
  // The series exists from the start, so an alert sees a zero, not a gap.
  EXPECT_TRUE(metrics_.Has(kConfigUnstable, {kDnBufferBelowTrainers}));
  EXPECT_EQ(Unstable(), 0);
  const uint64_t first = Join();
  Join();
  Join();
  Join(v1::ROLE_EVALUATOR);  // evaluators push nothing: not counted
  EXPECT_EQ(Unstable(), 0);
  std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, Not(HasSubstr("dn_buffer_size")));

  // The 4th trainer crosses N = 3; the 5th does not cross again.
  ::testing::internal::CaptureStderr();
  const uint64_t fourth = Join();
  EXPECT_EQ(Unstable(), 1);
  Join();
  EXPECT_EQ(Unstable(), 1);
  Leave(first);  // 4 trainers: still above
  EXPECT_EQ(Unstable(), 1);
  core_->Tick();
  Leave(fourth);  // 3 trainers: back within
  EXPECT_EQ(Unstable(), 0);
  core_->Tick();
  log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(Count(log, kExceed), 1u) << log;
  EXPECT_THAT(log, HasSubstr(absl::StrCat("4 live trainers ", kExceed)));
  EXPECT_THAT(log, HasSubstr("async Delayed Nesterov"));
  EXPECT_EQ(Count(log, kWithin), 1u) << log;

  // A second crossing warns again; expiring leases bring the count back down too.
  ::testing::internal::CaptureStderr();
  Join();
  EXPECT_EQ(Unstable(), 1);
  clock_.Advance(absl::Seconds(11));
  core_->Tick();
  EXPECT_EQ(Unstable(), 0);
  log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(Count(log, kExceed), 1u) << log;
  EXPECT_EQ(Count(log, kWithin), 1u) << log;
}

TEST_F(DnBufferCheckTest, MinWorkersAboveTheBufferWarnsAtStartAndHoldsTheGauge) {
  ::testing::internal::CaptureStderr();
  Make(DnConfig(v1::AGGREGATION_ASYNC, 4));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("aggregation.min_workers 4 exceeds outer_optimizer.dn_buffer_size 3"));
  EXPECT_EQ(Unstable(), 1);
  Join();  // the config alone says more trainers will come
  EXPECT_EQ(Unstable(), 1);
}

TEST_F(DnBufferCheckTest, SyncRoundsAndOtherOptimizersAreNotFlagged) {
  // A sync round is one outer step (one count of N) whatever the number of trainers.
  ::testing::internal::CaptureStderr();
  Make(DnConfig(v1::AGGREGATION_SYNC, 5));
  for (int i = 0; i < 5; ++i) Join();
  EXPECT_TRUE(metrics_.Has(kConfigUnstable, {kDnBufferBelowTrainers}));
  EXPECT_EQ(Unstable(), 0);

  v1::ServerConfig nesterov = DnConfig(v1::AGGREGATION_ASYNC, 5);
  nesterov.mutable_outer_optimizer()->set_type(v1::OUTER_NESTEROV);
  Make(nesterov);
  for (int i = 0; i < 5; ++i) Join();
  EXPECT_EQ(Unstable(), 0);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, Not(HasSubstr("dn_buffer_size")));
}

}  // namespace
}  // namespace aloe::server
