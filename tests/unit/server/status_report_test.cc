// The status page's snapshot of a core, its history ring and the JSON the page polls.
#include "server/core/status_report.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "common/status_matchers.h"
#include "server/core/server_metrics.h"
#include "tests/testing/server_core_calls.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::testing::HasSubstr;
using ::testing::Not;

// The tiny config with a stop condition and a batch of 4 sequences (32 tokens a step).
v1::ServerConfig TinyConfig() {
  v1::ServerConfig config = aloe::testing::TinyServerConfig();
  config.set_max_versions(40);
  config.mutable_inner_optimizer()->set_batch_size(4);
  return config;
}

class StatusReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = TinyConfig();
    auto core = ServerCore::Create(config_, {{"small", "a.tok", 1000}, {"large", "b.tok", 3000}},
                                   "heldout.tok", clock_, executor_, metrics_);
    ASSERT_THAT(core, IsOk());
    core_ = *std::move(core);
  }

  uint64_t Join(const std::string& name, v1::Role role) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_role(role);
    auto reply = core_->Join(request);
    EXPECT_THAT(reply, IsOk());
    return reply.ok() ? reply->worker_id() : 0;
  }

  PendingUpdate Update(uint64_t worker, const v1::Task& task, uint64_t bytes) {
    PendingUpdate u;
    u.worker_id = worker;
    u.task_id = task.task_id();
    u.base_version = task.base_version();
    u.steps_done = task.local_steps();
    u.compute_seconds = 2.0;  // 5 steps in 2 s: 2.5 steps/s
    u.tokens_learned = 100;
    u.received_bytes = bytes;
    for (const auto& layer : core_->spec().layers()) {
      u.layers.emplace_back(layer.num_elements(), 0.01f);
    }
    return u;
  }

  StatusSnapshot Capture() {
    return CaptureStatus(
        *core_, config_, "single process", clock_.Now(),
        [](uint64_t id) { return id == 1 ? std::string("alice") : std::string(); }, metrics_);
  }

  const StatusSnapshot::Worker* Find(const StatusSnapshot& s, const std::string& name) {
    for (const auto& w : s.workers) {
      if (w.live.name == name) return &w;
    }
    ADD_FAILURE() << "no worker " << name;
    return nullptr;
  }

  v1::ServerConfig config_;
  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
  std::unique_ptr<ServerCore> core_;
};

TEST_F(StatusReportTest, WorkersShowStateSpeedPushesBytesAndIdentity) {
  const uint64_t fast = Join("fast", v1::ROLE_TRAINER);
  const uint64_t slow = Join("slow", v1::ROLE_TRAINER);
  const uint64_t eval = Join("eval", v1::ROLE_EVALUATOR);
  const v1::Task tf = aloe::testing::RequestTaskOf(*core_, fast);
  const v1::Task ts = aloe::testing::RequestTaskOf(*core_, slow);
  ASSERT_EQ(tf.kind(), v1::Task::TRAIN);
  const absl::Time pushed = clock_.Now() + absl::Seconds(3);
  clock_.Advance(absl::Seconds(3));
  ASSERT_THAT(core_->SubmitUpdate(Update(fast, tf, 1234)), IsOk());
  clock_.Advance(absl::Seconds(4));

  const StatusSnapshot s = Capture();
  EXPECT_EQ(s.role, "single process");
  ASSERT_EQ(s.workers.size(), 3u);
  const StatusSnapshot::Worker* f = Find(s, "fast");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->identity, "alice");
  // Pushed, and its sync round waits for the slow one.
  EXPECT_EQ(f->live.state, "waiting");
  EXPECT_EQ(f->live.pushes, 1u);
  EXPECT_EQ(f->live.received_bytes, 1234u);
  ASSERT_TRUE(f->live.last_push.has_value());
  EXPECT_EQ(*f->live.last_push, pushed);
  EXPECT_EQ(f->live.last_staleness, 0u);
  EXPECT_DOUBLE_EQ(f->live.steps_per_second, 2.5);
  EXPECT_EQ(f->live.tokens_per_step, 4u * 8u);  // batch 4 x seq_len 8
  const StatusSnapshot::Worker* w = Find(s, "slow");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->live.state, "training");
  EXPECT_EQ(w->live.planned_steps, ts.local_steps());
  EXPECT_EQ(w->live.pushes, 0u);
  EXPECT_FALSE(w->live.last_push.has_value());
  EXPECT_EQ(w->identity, "");
  const StatusSnapshot::Worker* e = Find(s, "eval");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->live.role, v1::ROLE_EVALUATOR);
  EXPECT_EQ(e->live.id, eval);

  const std::string json = StatusJson(s, StatusHistory());
  // 4 s since the push; 2.5 steps/s of 32 tokens each.
  EXPECT_THAT(json, HasSubstr("\"name\":\"fast\",\"identity\":\"alice\",\"role\":\"trainer\","
                              "\"state\":\"waiting\",\"steps_per_second\":2.5,"
                              "\"tokens_per_second\":80,\"planned_steps\":0,"
                              "\"last_push_age\":4,\"staleness\":0,\"pushes\":1,"
                              "\"received_bytes\":1234"));
  EXPECT_THAT(json, HasSubstr("\"name\":\"slow\",\"identity\":\"\",\"role\":\"trainer\","
                              "\"state\":\"training\""));
  EXPECT_THAT(json, HasSubstr("\"last_push_age\":null"));
}

TEST_F(StatusReportTest, JobVersionDataShardsRejectionsCheckpointAndEvaluations) {
  const uint64_t a = Join("a", v1::ROLE_TRAINER);
  const uint64_t b = Join("b", v1::ROLE_TRAINER);
  const uint64_t e = Join("e", v1::ROLE_EVALUATOR);
  const v1::Task ta = aloe::testing::RequestTaskOf(*core_, a);
  const v1::Task tb = aloe::testing::RequestTaskOf(*core_, b);
  ASSERT_THAT(core_->SubmitUpdate(Update(a, ta, 10)), IsOk());
  ASSERT_THAT(core_->SubmitUpdate(Update(b, tb, 10)), IsOk());
  ASSERT_EQ(core_->version(), 1u);
  // A second push of the same task is stale.
  EXPECT_FALSE(core_->SubmitUpdate(Update(a, ta, 10)).ok());
  const v1::Task te = aloe::testing::RequestTaskOf(*core_, e);
  ASSERT_EQ(te.kind(), v1::Task::EVAL);
  v1::EvalReport report;
  report.set_worker_id(e);
  report.set_task_id(te.task_id());
  report.set_version(te.base_version());
  report.set_loss(2.0);
  report.set_tokens(10);
  ASSERT_THAT(core_->ReportEval(report), IsOk());
  metrics_.Set(kCheckpointTimestamp, absl::ToDoubleSeconds(clock_.Now() - absl::UnixEpoch()) - 30);
  metrics_.Set(kCheckpointVersion, 1);

  const StatusSnapshot s = Capture();
  EXPECT_EQ(s.version, 1u);
  EXPECT_EQ(s.max_versions, 40u);
  EXPECT_EQ(s.updates_applied, 2u);
  EXPECT_GT(s.parameters, 0u);
  ASSERT_EQ(s.data_shards.size(), 2u);
  EXPECT_EQ(s.data_shards[0].name, "small");
  EXPECT_EQ(s.data_shards[0].tokens, 1000u);
  EXPECT_EQ(s.data_shards[0].tokens_learned + s.data_shards[1].tokens_learned, 200u);
  double stale = -1;
  for (const auto& [reason, count] : s.rejections) {
    if (reason == "stale") stale = count;
  }
  EXPECT_EQ(stale, 1);
  ASSERT_TRUE(s.checkpoint_version.has_value());
  EXPECT_EQ(*s.checkpoint_version, 1u);
  ASSERT_EQ(s.evals.size(), 1u);
  EXPECT_EQ(s.evals[0].version, te.base_version());
  EXPECT_DOUBLE_EQ(s.evals[0].loss, 2.0);
  bool sync_shown = false;
  for (const auto& [key, value] : s.job) {
    if (key == "aggregation") sync_shown = value.rfind("sync", 0) == 0;
  }
  EXPECT_TRUE(sync_shown);

  const std::string json = StatusJson(s, StatusHistory());
  EXPECT_THAT(json, HasSubstr("\"version\":1,\"max_versions\":40,\"updates_applied\":2"));
  EXPECT_THAT(json, HasSubstr("\"size_share\":0.25"));
  EXPECT_THAT(json, HasSubstr("\"size_share\":0.75"));
  EXPECT_THAT(json, HasSubstr("[\"stale\",1]"));
  EXPECT_THAT(json, HasSubstr("\"checkpoint\":{\"version\":1,\"age\":30}"));
  EXPECT_THAT(json, HasSubstr(absl::StrCat("\"evals\":[[", te.base_version(), ",2]]")));
  EXPECT_THAT(json, HasSubstr("\"shard_processes\":[]"));
}

TEST_F(StatusReportTest, NoCheckpointIsNull) {
  const std::string json = StatusJson(Capture(), StatusHistory());
  EXPECT_THAT(json, HasSubstr("\"checkpoint\":null"));
  EXPECT_THAT(json, HasSubstr("\"workers\":[]"));
}

TEST(StatusJsonTest, EscapesNamesSoThatThePageStaysAPage) {
  StatusSnapshot s;
  s.role = "r\"o</script>le\\";
  s.now = absl::UnixEpoch() + absl::Seconds(100);
  const std::string json = StatusJson(s, StatusHistory());
  EXPECT_THAT(json, HasSubstr("\"role\":\"r\\\"o\\u003c/script>le\\\\\""));
  EXPECT_THAT(json, Not(HasSubstr("</script>")));
  EXPECT_THAT(json, HasSubstr("\"now\":100,"));
}

TEST(StatusHistoryTest, KeepsVersionChangesAndNewEvaluationsOnly) {
  const absl::Time t0 = absl::UnixEpoch() + absl::Seconds(1000);
  StatusHistory h(100);
  const std::vector<EvalPoint> evals = {{1, 3.0}, {2, 2.5}};
  h.Record(t0, 0, {});
  h.Record(t0 + absl::Seconds(2), 0, {});  // unchanged: no sample
  h.Record(t0 + absl::Seconds(3), 2, absl::MakeConstSpan(evals).subspan(0, 1));
  h.Record(t0 + absl::Seconds(5), 2, evals);  // only version 2's evaluation is new
  ASSERT_EQ(h.versions().size(), 2u);
  EXPECT_EQ(h.versions()[1].version, 2u);
  EXPECT_EQ(h.versions()[1].time, t0 + absl::Seconds(3));
  ASSERT_EQ(h.losses().size(), 2u);
  EXPECT_EQ(h.losses()[0].time, t0 + absl::Seconds(3));
  EXPECT_EQ(h.losses()[1].version, 2u);
  EXPECT_EQ(h.losses()[1].time, t0 + absl::Seconds(5));

  StatusSnapshot s;
  s.now = t0 + absl::Seconds(10);
  EXPECT_THAT(StatusJson(s, h), HasSubstr("\"history\":{\"versions\":[[-10,0],[-7,2]],"
                                          "\"losses\":[[-7,1,3],[-5,2,2.5]]}"));
}

TEST(StatusHistoryTest, ChangesWithinTheMinimumGapShareOneSample) {
  const absl::Time t0 = absl::UnixEpoch();
  StatusHistory h(100);
  h.Record(t0, 0, {});
  h.Record(t0 + absl::Seconds(2), 1, {});
  h.Record(t0 + absl::Milliseconds(2300), 2, {});
  h.Record(t0 + absl::Milliseconds(2600), 3, {});
  ASSERT_EQ(h.versions().size(), 2u);
  EXPECT_EQ(h.versions()[1].version, 3u);
  EXPECT_EQ(h.versions()[1].time, t0 + absl::Seconds(2));
}

TEST(StatusHistoryTest, IsBoundedAndDropsTheOldest) {
  const absl::Time t0 = absl::UnixEpoch();
  StatusHistory h(5);
  std::vector<EvalPoint> evals;
  for (uint64_t v = 1; v <= 12; ++v) {
    evals.push_back({v, 10.0 / v});
    h.Record(t0 + absl::Seconds(2 * v), v, evals);
  }
  ASSERT_EQ(h.versions().size(), 5u);
  EXPECT_EQ(h.versions().front().version, 8u);
  EXPECT_EQ(h.versions().back().version, 12u);
  ASSERT_EQ(h.losses().size(), 5u);
  EXPECT_EQ(h.losses().front().version, 8u);
}

TEST(StatusHistoryTest, AHistoryThatWentBackIsNotReplayed) {
  const absl::Time t0 = absl::UnixEpoch();
  StatusHistory h(100);
  h.Record(t0, 5, std::vector<EvalPoint>{{4, 2.0}, {5, 1.9}});
  // A coordinator restored to version 3 reports its own history from there on.
  h.Record(t0 + absl::Seconds(2), 3, std::vector<EvalPoint>{{3, 2.1}});
  EXPECT_EQ(h.losses().size(), 2u);
  h.Record(t0 + absl::Seconds(4), 4, std::vector<EvalPoint>{{3, 2.1}, {4, 2.05}});
  ASSERT_EQ(h.losses().size(), 3u);
  EXPECT_EQ(h.losses().back().version, 4u);
  EXPECT_DOUBLE_EQ(h.losses().back().loss, 2.05);
}

TEST(ShardProcessStatusTest, ReadsVersionStagingAndBytesFromTheMetrics) {
  v1::ServerConfig config = TinyConfig();
  config.set_shard_processes(2);
  RecordingMetrics metrics;
  metrics.Set(kModelVersion, 17);
  metrics.Set(kStagedUpdates, 2);
  metrics.Add(kReceivedBytes, 300, {"fp32"});
  metrics.Add(kReceivedBytes, 40, {"int8_blockwise"});
  const StatusSnapshot s =
      CaptureShardProcessStatus(config, 1, absl::UnixEpoch() + absl::Seconds(5), metrics);
  EXPECT_EQ(s.role, "shard process 1 of 2");
  EXPECT_EQ(s.version, 17u);
  const std::string json = StatusJson(s, StatusHistory());
  EXPECT_THAT(json, HasSubstr("[\"staged updates\",2]"));
  EXPECT_THAT(json, HasSubstr("[\"received bytes\",340]"));
  EXPECT_THAT(json, HasSubstr("[\"parameters held\",\"2 shard processes\"]"));
}

TEST(StatusHtmlTest, IsOneSelfContainedDocumentThatPollsTheJson) {
  const std::string html = StatusHtml();
  EXPECT_THAT(html, HasSubstr("fetch(\"status.json\""));
  EXPECT_THAT(html, HasSubstr("id=\"plot-version\""));
  EXPECT_THAT(html, HasSubstr("id=\"plot-loss\""));
  // No external assets: nothing is loaded from another address.
  EXPECT_THAT(html, Not(HasSubstr("http://")));
  EXPECT_THAT(html, Not(HasSubstr("https://")));
  EXPECT_THAT(html, Not(HasSubstr(" src=")));
  EXPECT_THAT(html, Not(HasSubstr("<link")));
  EXPECT_THAT(html, Not(HasSubstr("method=")));  // no forms: the page changes nothing
}

}  // namespace
}  // namespace aloe::server
