// The algorithm must not depend on where the parameters live: the same ServerCore script over
// LocalParameters (one process) and ShardCommitLog (a coordinator and its shard processes) hands
// out the same tasks, applies the same updates at the same versions, refuses the same pushes and
// checkpoints the same bookkeeping.
#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/status_matchers.h"
#include "server/core/server_core.h"
#include "server/core/server_metrics.h"
#include "tests/testing/server_core_calls.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;

// A tiny model in sync rounds of two trainers, SGD, three versions, a checkpoint every version.
v1::ServerConfig ConfigOf(uint32_t shard_processes) {
  v1::ServerConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"(model { vocab_size: 16 seq_len: 8 d_model: 8 num_layers: 2 num_heads: 2 }
         corpus_dir: "unused" local_steps: 5 max_versions: 3
         aggregation { min_workers: 2 }
         outer_optimizer { type: OUTER_SGD lr: 0.5 }
         checkpoint { dir: "unused" every_versions: 1 })",
      &config));
  config.set_shard_processes(shard_processes);
  FillServerDefaults(&config);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

// A ServerCore over the backend of `shard_processes` (0: this process holds the parameters; N:
// a coordinator whose N shard processes all follow), fed the way its services feed it.
class Deployment {
 public:
  explicit Deployment(uint32_t shard_processes) : shard_processes_(shard_processes) {
    auto core =
        ServerCore::Create(ConfigOf(shard_processes), {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                           "heldout.tok", clock_, executor_, metrics_);
    EXPECT_THAT(core, IsOk());
    core_ = *std::move(core);
    for (uint32_t i = 0; i < shard_processes; ++i) {
      core_->SetShardAddress(i, absl::StrCat("127.0.0.1:", 7001 + i));
    }
  }

  ServerCore& core() { return *core_; }
  RecordingMetrics& metrics() { return metrics_; }

  uint64_t Join() { return ::aloe::testing::JoinTrainer(*core_); }
  v1::Task Request(uint64_t worker) { return ::aloe::testing::RequestTaskOf(*core_, worker); }

  void Leave(uint64_t worker) {
    v1::LeaveRequest request;
    request.set_worker_id(worker);
    EXPECT_THAT(core_->Leave(request), IsOk());
  }

  // `worker`'s update of `task`, every element `value`: the whole update submitted at once in
  // one process, else admitted and staged by every shard process in turn (the last part's
  // reply, or the first refusal).
  absl::StatusOr<v1::PushReply> Push(uint64_t worker, const v1::Task& task, float value) {
    PendingUpdate update;
    update.worker_id = worker;
    update.task_id = task.task_id();
    update.update_id = ++update_ids_;
    update.base_version = task.base_version();
    update.steps_done = task.local_steps();
    update.tokens_learned = 100;
    if (shard_processes_ == 0) {
      for (const auto& layer : core_->spec().layers()) {
        update.layers.emplace_back(layer.num_elements(), value);
      }
      return core_->SubmitUpdate(std::move(update));
    }
    v1::PushHeader header;
    header.set_worker_id(worker);
    header.set_task_id(update.task_id);
    header.set_update_id(update.update_id);
    header.set_base_version(update.base_version);
    header.set_steps_done(update.steps_done);
    header.set_tokens_learned(update.tokens_learned);
    absl::StatusOr<v1::PushReply> reply;
    for (uint32_t shard = 0; shard < shard_processes_; ++shard) {
      absl::StatusOr<bool> admitted = core_->AdmitPush(header);
      if (!admitted.ok()) return admitted.status();
      EXPECT_TRUE(*admitted);
      reply = core_->SubmitShardPart(shard, header);
      if (!reply.ok()) return reply;
    }
    return reply;
  }

  double Rejected() const {
    double total = 0;
    for (const char* reason : kRejectReasons) {
      total += metrics_.Value("aloe_updates_rejected_total", {reason});
    }
    return total;
  }

 private:
  const uint32_t shard_processes_;
  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
  std::unique_ptr<ServerCore> core_;
  uint64_t update_ids_ = 0;
};

std::string Describe(const v1::Task& task) {
  return absl::StrFormat("%s id=%d base=%d shard=%s steps=%d seed=%d lr_step=%d",
                         v1::Task::Kind_Name(task.kind()), task.task_id(), task.base_version(),
                         task.shard_name(), task.local_steps(), task.seed(), task.lr_step());
}

std::string Describe(const absl::StatusOr<v1::PushReply>& reply) {
  if (!reply.ok()) return absl::StrCat("refused ", absl::StatusCodeToString(reply.status().code()));
  return absl::StrFormat("applied=%d version=%d staleness=%d", reply->applied(), reply->version(),
                         reply->staleness());
}

// Three sync rounds of min_workers 2: a round both push, a round one of them leaves (which
// completes it with the other's update), a round with a newcomer; then STOP at max_versions 3.
// Returns what the workers saw, line by line.
std::vector<std::string> RunScript(Deployment& d) {
  std::vector<std::string> seen;
  const uint64_t a = d.Join();
  const uint64_t b = d.Join();
  seen.push_back(absl::StrCat("joined ", a, " ", b));
  v1::Task ta = d.Request(a);
  v1::Task tb = d.Request(b);
  seen.push_back(Describe(ta));
  seen.push_back(Describe(tb));
  seen.push_back(Describe(d.Push(a, ta, 1.0f)));
  seen.push_back(Describe(d.Push(a, ta, 1.0f)));  // pushed already: refused
  seen.push_back(Describe(d.Push(b, tb, 3.0f)));
  ta = d.Request(a);
  tb = d.Request(b);
  seen.push_back(Describe(ta));
  seen.push_back(Describe(tb));
  seen.push_back(Describe(d.Push(b, tb, 2.0f)));
  d.Leave(a);  // the round completes with b's update alone
  seen.push_back(absl::StrCat("after leave: version ", d.core().version()));
  const uint64_t c = d.Join();
  tb = d.Request(b);
  v1::Task tc = d.Request(c);
  seen.push_back(Describe(tb));
  seen.push_back(Describe(tc));
  seen.push_back(Describe(d.Push(c, tc, 1.0f)));
  seen.push_back(Describe(d.Push(b, tb, 1.0f)));
  seen.push_back(Describe(d.Request(b)));
  d.Leave(b);
  d.Leave(c);
  seen.push_back(absl::StrCat("finished ", d.core().Finished()));
  return seen;
}

class ParameterBackendConformanceTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(ParameterBackendConformanceTest, TheScriptReachesTheStopWithTheSameCounts) {
  Deployment d(GetParam());
  const std::vector<std::string> seen = RunScript(d);
  EXPECT_EQ(d.core().version(), 3u);
  EXPECT_EQ(d.core().updates_applied(), 5u);  // 2 + 1 (a left) + 2
  EXPECT_TRUE(d.core().Finished());
  EXPECT_EQ(d.metrics().Value("aloe_model_version"), 3);
  EXPECT_EQ(d.metrics().Value("aloe_updates_applied_total"), 5);
  EXPECT_EQ(d.metrics().Value("aloe_tokens_learned_total"), 500);
  EXPECT_EQ(d.Rejected(), 1);  // the repeated push
  EXPECT_EQ(seen[4], "refused FAILED_PRECONDITION");
  EXPECT_EQ(seen.back(), "finished 1");
  // One checkpoint per version fell due (every_versions 1): a sharded coordinator keeps them
  // all for writing, one process only the newest.
  const std::vector<v1::ServerCheckpoint> due = d.core().TakeDueCheckpoints();
  ASSERT_FALSE(due.empty());
  EXPECT_EQ(due.back().version(), 3u);
  EXPECT_EQ(due.size(), GetParam() == 0 ? 1u : 3u);
}

TEST_P(ParameterBackendConformanceTest, ACheckpointRestoresTheBookkeepingIntoAFreshCore) {
  Deployment d(GetParam());
  RunScript(d);
  const v1::ServerCheckpoint saved = d.core().CaptureCheckpoint();
  Deployment fresh(GetParam());
  ASSERT_THAT(fresh.core().RestoreCheckpoint(saved), IsOk());
  EXPECT_EQ(fresh.core().version(), 3u);
  EXPECT_EQ(fresh.core().updates_applied(), 5u);
  EXPECT_TRUE(fresh.core().stopping());  // max_versions 3 is reached
  const v1::ServerCheckpoint again = fresh.core().CaptureCheckpoint();
  EXPECT_EQ(again.next_task_id(), saved.next_task_id());
  EXPECT_EQ(again.next_worker_id(), saved.next_worker_id());
  EXPECT_EQ(again.layer_params_size(), saved.layer_params_size());
  // A checkpoint of the other layout is refused, and changes nothing.
  Deployment other(GetParam() == 0 ? 2 : 0);
  RunScript(other);
  EXPECT_THAT(
      fresh.core().RestoreCheckpoint(other.core().CaptureCheckpoint()),
      StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("another model")));
  EXPECT_EQ(fresh.core().version(), 3u);
}

INSTANTIATE_TEST_SUITE_P(Backends, ParameterBackendConformanceTest, ::testing::Values(0u, 2u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return info.param == 0 ? std::string("LocalParameters")
                                                  : absl::StrCat("ShardCommitLogOf", info.param);
                         });

TEST(ParameterBackendConformance, BothBackendsSeeTheSameTasksRepliesAndCheckpoints) {
  Deployment local(0);
  Deployment sharded(2);
  EXPECT_EQ(RunScript(local), RunScript(sharded));
  const v1::ServerCheckpoint l = local.core().CaptureCheckpoint();
  const v1::ServerCheckpoint s = sharded.core().CaptureCheckpoint();
  EXPECT_EQ(l.version(), s.version());
  EXPECT_EQ(l.updates_applied(), s.updates_applied());
  EXPECT_EQ(l.next_task_id(), s.next_task_id());
  EXPECT_EQ(l.next_worker_id(), s.next_worker_id());
  EXPECT_EQ(std::vector<uint64_t>(l.shard_steps().begin(), l.shard_steps().end()),
            std::vector<uint64_t>(s.shard_steps().begin(), s.shard_steps().end()));
  EXPECT_EQ(std::vector<uint64_t>(l.shard_tokens().begin(), l.shard_tokens().end()),
            std::vector<uint64_t>(s.shard_tokens().begin(), s.shard_tokens().end()));
  EXPECT_EQ(l.sampler_rng(), s.sampler_rng());
  EXPECT_EQ(l.stopping(), s.stopping());
  // Only one process holds parameters: the shard processes checkpoint their own.
  EXPECT_EQ(l.layer_params_size(), local.core().spec().layers_size());
  EXPECT_EQ(s.layer_params_size(), 0);
}

}  // namespace
}  // namespace aloe::server
