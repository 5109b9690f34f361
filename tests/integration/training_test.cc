// End to end on loopback: real aloe-server and aloe-worker processes on OS-chosen ports, a tiny
// model trained on a small corpus of real text, and hostile pushes from a raw gRPC client
// (tests/integration/loopback_cluster.h has the fixtures).
#include <gtest/gtest.h>
#include <signal.h>

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::HttpGet;
using ::aloe::testing::LoopbackTest;
using ::aloe::testing::RawClientTest;
using ::aloe::testing::ReadFile;
using ::aloe::testing::SummaryValue;

constexpr char kEightRounds[] = R"(
      local_steps: 12
      max_versions: 8
      eval_every: 1
      aggregation { min_workers: 2 })";

TEST_F(LoopbackTest, TwoWorkersTrainAndEvalLossFalls) {
  TrainingRun run;
  ASSERT_NO_FATAL_FAILURE(TrainTwoWorkers(kEightRounds, kNesterov, &run));
  EXPECT_EQ(run.scrape.find("aloe_model_version 0"), std::string::npos) << run.scrape;
  EXPECT_NE(run.scrape.find("aloe_updates_applied_total"), std::string::npos) << run.scrape;
  EXPECT_NE(run.scrape.find("aloe_apply_latency_seconds_bucket"), std::string::npos);
  ExpectEightRoundsAndEvalLossFalls(run);
  // The push that completes a round gets its worker's next task in the reply (the task from the
  // new version, or STOP after the last): one per round. The other worker asks RequestTask.
  EXPECT_EQ(SummaryValue(ReadFile(dir_ + "/trainer0.log"), "tasks_from_push_replies") +
                SummaryValue(ReadFile(dir_ + "/trainer1.log"), "tasks_from_push_replies"),
            8)
      << Logs();
}

// The same training with the EDiT pseudo-gradient penalty (paper 000 Alg. 2) aggregating the
// rounds: norm-softmax weights, clipping, anomaly test after a short warmup.
TEST_F(LoopbackTest, PenaltyWithNesterovTrainsAndEvalLossFalls) {
  TrainingRun run;
  ASSERT_NO_FATAL_FAILURE(TrainTwoWorkers(absl::StrCat(kEightRounds, R"(
      penalty { enabled: true warmup: 2 })"),
                                          kNesterov, &run));
  EXPECT_NE(run.scrape.find("aloe_penalty_weight_count"), std::string::npos) << run.scrape;
  EXPECT_NE(run.scrape.find("aloe_pseudo_gradient_norm_bucket"), std::string::npos);
  ExpectEightRoundsAndEvalLossFalls(run);
}

// Delayed Nesterov (paper 002 Alg. 3) with a buffer of 2 behind the penalty.
TEST_F(LoopbackTest, PenaltyWithDelayedNesterovTrainsAndEvalLossFalls) {
  TrainingRun run;
  ASSERT_NO_FATAL_FAILURE(TrainTwoWorkers(
      absl::StrCat(kEightRounds, R"(
      penalty { enabled: true warmup: 2 })"),
      "outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 2 }",
      &run));
  ExpectEightRoundsAndEvalLossFalls(run);
}

// Rounds a trainer completed, from its closing summary line.
int RoundsOf(const std::string& log) { return SummaryValue(log, "rounds"); }

// Pushes quantised to int8 blockwise (blocks of 64) with error feedback, the embedding in bf16:
// training still converges, and the wire carries about a quarter of the fp32 bytes.
TEST_F(LoopbackTest, Int8PushesWithErrorFeedbackTrainAndEvalLossFalls) {
  TrainingRun run;
  ASSERT_NO_FATAL_FAILURE(TrainTwoWorkers(absl::StrCat(kEightRounds, R"(
      transport {
        codec: CODEC_INT8_BLOCKWISE
        int8_block_size: 64
        error_feedback: true
        layer_codecs { layer: "embed" codec: CODEC_BF16 }
      })"),
                                          kNesterov, &run));
  ExpectEightRoundsAndEvalLossFalls(run);
  // Wire bytes per push vs fp32: int8 + one fp32 scale per 64 values (+ bf16 embedding).
  v1::TransformerConfig model;
  model.set_vocab_size(256);
  model.set_seq_len(32);
  model.set_d_model(64);
  model.set_num_layers(2);
  model.set_num_heads(2);
  FillTransformerDefaults(&model);
  const double fp32_bytes = 4.0 * TotalElements(BuildTransformerSpec(model, 1));
  const std::string log = ReadFile(dir_ + "/trainer0.log");
  const size_t at = log.find("pushed_bytes=");
  ASSERT_NE(at, std::string::npos) << log;
  double pushed = 0;
  ASSERT_TRUE(
      absl::SimpleAtod(log.substr(at + 13, log.find_first_of(" \n", at) - at - 13), &pushed));
  const double per_round = pushed / RoundsOf(log);
  EXPECT_LT(per_round, 0.40 * fp32_bytes) << per_round << " of " << fp32_bytes;
  EXPECT_GT(per_round, 0.25 * fp32_bytes);
}

// Asynchronous mode (paper 002 Alg. 2/5) with Delayed Nesterov and a short grace period: the
// fast trainer is not held back by the one slowed 3x, so it completes more rounds; loss falls.
TEST_F(LoopbackTest, AsyncFastWorkerDoesMoreRoundsAndEvalLossFalls) {
  TrainingRun run;
  ASSERT_NO_FATAL_FAILURE(TrainTwoWorkers(
      R"(
      local_steps: 12
      max_versions: 16
      eval_every: 4
      aggregation { mode: AGGREGATION_ASYNC grace_seconds: 0.05 })",
      "outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9 dn_buffer_size: 2 }",
      &run, /*slowdown=*/3.0));
  const int fast = RoundsOf(ReadFile(dir_ + "/trainer0.log"));
  const int slow = RoundsOf(ReadFile(dir_ + "/trainer1.log"));
  EXPECT_GT(fast, slow) << Logs();
  EXPECT_GE(slow, 1) << Logs();
  int version = 0;
  ASSERT_TRUE(absl::SimpleAtoi(run.summary["version"], &version));
  EXPECT_GE(version, 16);
  EXPECT_EQ(run.summary["updates_applied"], run.summary["version"]);  // one step per update
  EXPECT_NE(run.scrape.find("aloe_update_staleness_bucket"), std::string::npos) << run.scrape;
  ASSERT_GE(run.evals.size(), 2u) << Logs();
  EXPECT_EQ(run.evals.front().first, 0);
  EXPECT_EQ(run.evals.back().first, version);
  EXPECT_LT(run.evals.back().second, run.evals.front().second - 1.5)
      << "eval loss " << run.evals.front().second << " -> " << run.evals.back().second << "\n"
      << Logs();
}

TEST_F(RawClientTest, BadPushesAreRejectedWithClearStatusAndChangeNothing) {
  const int port = StartServer("local_steps: 3\n");
  ASSERT_GT(port, 0);
  Connect(port);
  v1::JoinReply joined;
  v1::Task task;
  ASSERT_NO_FATAL_FAILURE(JoinTrainer("hostile", &joined, &task));
  const auto before = PullLatest(joined.worker_id());
  const v1::PushHeader header = HeaderFor(joined, task);

  struct Case {
    const char* what;
    grpc::StatusCode code;
    const char* message;
    std::function<void(v1::PushHeader*, std::vector<v1::PushChunk>*)> mutate;
  };
  const Case cases[] = {
      {"unknown layer", grpc::StatusCode::INVALID_ARGUMENT, "unknown layer 4242",
       [](v1::PushHeader*, std::vector<v1::PushChunk>* c) { (*c)[0].set_layer_id(4242); }},
      {"wrong size", grpc::StatusCode::INVALID_ARGUMENT, "wrong size",
       [](v1::PushHeader*, std::vector<v1::PushChunk>* c) {
         c->back().mutable_data()->append(std::string(8, '\0'));
       }},
      {"missing layer", grpc::StatusCode::INVALID_ARGUMENT, "incomplete",
       [](v1::PushHeader*, std::vector<v1::PushChunk>* c) { c->pop_back(); }},
      {"NaN", grpc::StatusCode::INVALID_ARGUMENT, "non-finite",
       [](v1::PushHeader*, std::vector<v1::PushChunk>* c) {
         float nan = std::nanf("");
         (*c)[1].mutable_data()->replace(4, 4, reinterpret_cast<const char*>(&nan), 4);
       }},
      {"stale version", grpc::StatusCode::FAILED_PRECONDITION, "stale version",
       [](v1::PushHeader* h, std::vector<v1::PushChunk>*) { h->set_base_version(99); }},
      {"not float32", grpc::StatusCode::INVALID_ARGUMENT, "not float32",
       [](v1::PushHeader*, std::vector<v1::PushChunk>* c) {
         (*c)[0].mutable_data()->push_back('x');
       }},
  };
  for (const Case& c : cases) {
    v1::PushHeader h = header;
    std::vector<v1::PushChunk> chunks = FullUpdate(0.5f);
    c.mutate(&h, &chunks);
    grpc::Status status = Push(h, chunks);
    EXPECT_EQ(status.error_code(), c.code) << c.what << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos)
        << c.what << ": " << status.error_message();
    EXPECT_EQ(PullLatest(joined.worker_id()), before) << c.what << " changed the parameters";
  }
  // The well-formed push is applied (single worker: one round of one update).
  grpc::Status ok = Push(header, FullUpdate(0.5f));
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_NE(PullLatest(joined.worker_id()), before);
  EXPECT_EQ(Scraped("aloe_updates_rejected_total{reason=\"invalid_argument\"}"), 5);
  EXPECT_EQ(Scraped("aloe_updates_rejected_total{reason=\"stale\"}"), 1);
  EXPECT_EQ(Scraped("aloe_updates_rejected_total{reason=\"unknown_worker\"}"), 0);
  EXPECT_EQ(Scraped("aloe_model_version"), 1);
  EXPECT_GT(Scraped("aloe_received_bytes_total{codec=\"fp32\"}"), 0);
  EXPECT_GT(Scraped("aloe_sent_bytes_total{codec=\"fp32\"}"), 0);
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(20)), std::optional<int>(0));
}

}  // namespace
}  // namespace aloe
