// A multi-rank worker node (aloe-worker --nproc 2: FSDP over Gloo, each rank pulling and pushing
// only its slice of every layer) against a real aloe-server: the server merges the slices into
// one update per round, and the job ends where the same job with a one-process worker ends.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/tensor_codec.h"
#include "server/core/checkpoint_store.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::FreePort;
using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

// Every "pushed_bytes=N" of the closing summaries in `log` (one per rank).
std::vector<double> PushedBytes(const std::string& log) {
  std::vector<double> values;
  for (size_t at = log.find("pushed_bytes="); at != std::string::npos;
       at = log.find("pushed_bytes=", at + 1)) {
    double bytes = 0;
    const size_t begin = at + 13;
    if (absl::SimpleAtod(log.substr(begin, log.find_first_of(" \n", begin) - begin), &bytes)) {
      values.push_back(bytes);
    }
  }
  return values;
}

// ||a - b|| / ||b|| over equally long parameter vectors.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += std::pow(static_cast<double>(a[i]) - b[i], 2);
    norm += std::pow(static_cast<double>(b[i]), 2);
  }
  return std::sqrt(diff / norm);
}

class FsdpWorkerTest : public LoopbackTest {
 protected:
  // Runs a 3-round sync job with one worker started with `worker_flags` (and the server with
  // `server_flags`); returns the final parameters (from the checkpoint written at exit) as floats.
  std::vector<float> RunJob(const std::string& name, const std::vector<std::string>& worker_flags,
                            const std::vector<std::string>& server_flags = {}) {
    const std::string ckpt = RunSingleTrainerJob(name, "local_steps: 6\nmax_versions: 3\n",
                                                 worker_flags, /*evaluate=*/false, server_flags);
    const std::string summary = ReadFile(dir_ + "/summary");
    EXPECT_TRUE(absl::StrContains(summary, "version=3")) << summary << Logs();
    // One update per round: the two slices of each round were merged, not counted twice.
    EXPECT_TRUE(absl::StrContains(summary, "updates_applied=3")) << summary << Logs();
    logs_[name] = ReadFile(dir_ + "/" + name + ".log");
    auto loaded = server::CheckpointStore(ckpt, 1).LoadLatest();
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) return {};
    std::vector<float> params;
    for (const std::string& layer : loaded->checkpoint.layer_params()) {
      std::vector<float> values(layer.size() / sizeof(float));
      EXPECT_TRUE(DecodeFloats(layer, absl::MakeSpan(values)).ok());
      params.insert(params.end(), values.begin(), values.end());
    }
    return params;
  }

  std::map<std::string, std::string> logs_;
};

TEST_F(FsdpWorkerTest, TwoRankNodeTrainsLikeAOneProcessWorker) {
  const std::vector<float> one = RunJob("one", {});
  const std::vector<float> two = RunJob("two", {"--nproc=2"});
  ASSERT_FALSE(one.empty());
  ASSERT_EQ(one.size(), two.size());
  EXPECT_TRUE(absl::StrContains(logs_["two"], "(2 ranks)")) << logs_["two"];
  // Each rank pushed only its slice: the two ranks' pushed bytes are about half each and add up
  // to the one-process worker's. (Whether a rank's log says "slices in" depends on which rank's
  // push arrives first, so the bytes are what is checked.)
  const std::vector<double> one_bytes = PushedBytes(logs_["one"]);
  const std::vector<double> two_bytes = PushedBytes(logs_["two"]);
  ASSERT_EQ(one_bytes.size(), 1u) << logs_["one"];
  ASSERT_EQ(two_bytes.size(), 2u) << logs_["two"];
  EXPECT_EQ(two_bytes[0] + two_bytes[1], one_bytes[0]) << logs_["two"];
  EXPECT_LT(std::max(two_bytes[0], two_bytes[1]), 0.51 * one_bytes[0]) << logs_["two"];
  EXPECT_FALSE(absl::StrContains(logs_["two"], "dropped")) << logs_["two"];
  const double relative = RelativeError(two, one);
  std::printf("2-rank node vs 1-process worker after 3 rounds: relative error %.3g\n", relative);
  EXPECT_LE(relative, 1e-4) << logs_["two"];
}

// A single-process server with --push_listen: the two ranks of a node push their float32 slices
// raw (JoinReply.push_address) and the job ends where the same job with gRPC pushes ends.
TEST_F(FsdpWorkerTest, RawPushesOfATwoRankNodeToOneServerTrainLikeGrpcPushes) {
  const std::vector<float> grpc = RunJob("grpc", {"--nproc=2"});
  const std::vector<float> raw =
      RunJob("raw", {"--nproc=2"}, {absl::StrCat("--push_listen=127.0.0.1:", FreePort())});
  ASSERT_FALSE(grpc.empty());
  ASSERT_EQ(raw.size(), grpc.size());
  // Every pushed byte came raw: 3 rounds x the two ranks' slices.
  const std::vector<double> pushed = PushedBytes(logs_["raw"]);
  ASSERT_EQ(pushed.size(), 2u) << logs_["raw"];
  const std::string server_log = ReadFile(dir_ + "/raw.server.log");
  EXPECT_TRUE(
      absl::StrContains(server_log, absl::StrFormat("raw pushes: %d bytes received whole",
                                                    static_cast<uint64_t>(pushed[0] + pushed[1]))))
      << server_log;
  EXPECT_FALSE(absl::StrContains(ReadFile(dir_ + "/grpc.server.log"), "raw pushes")) << "grpc";
  const double relative = RelativeError(raw, grpc);
  std::printf("raw vs gRPC pushes after 3 rounds: relative error %.3g\n", relative);
  EXPECT_LE(relative, 1e-6) << logs_["raw"];
}

// transport {} with error feedback and every layer pushed as rank-16 factors in int4 blocks of 64
// (tests/integration/low_rank_codec_test.cc's paper 001 case).
std::string LowRankInt4Transport() {
  std::string transport = "transport { error_feedback: true int4_block_size: 64";
  for (const char* layer : {"embed", "blocks.0", "blocks.1", "head"}) {
    absl::StrAppend(&transport, " layer_codecs { layer: \"", layer,
                    "\" codec: CODEC_LOWRANK rank: 16 factor_codec: CODEC_INT4_BLOCKWISE }");
  }
  return transport + " }\n";
}

// A 2-rank node pushes low-rank + int4 factors with error feedback: its ranks compute every
// tensor's factors together from their slices (no rank holds a whole pseudo-gradient matrix)
// and each pushes its part. The held-out loss falls as a one-process worker's does with the
// same codec, and the node pushes about as many bytes: the low-rank size, a fifteenth of float32.
TEST_F(FsdpWorkerTest, TwoRankNodePushesLowRankInt4FactorsWithErrorFeedback) {
  constexpr int kVersions = 8;
  const std::string config =
      absl::StrCat("local_steps: 12\nmax_versions: ", kVersions, "\n", LowRankInt4Transport());
  RunSingleTrainerJob("one", config, {}, /*evaluate=*/true);
  const double one_loss = FinalEvalLoss();
  const std::vector<double> one_bytes = PushedBytes(ReadFile(dir_ + "/one.log"));
  const std::string ckpt = RunSingleTrainerJob("two", config, {"--nproc=2"}, /*evaluate=*/true);
  const double two_loss = FinalEvalLoss();
  const std::string log = ReadFile(dir_ + "/two.log");
  const std::vector<double> two_bytes = PushedBytes(log);
  ASSERT_EQ(one_bytes.size(), 1u) << ReadFile(dir_ + "/one.log");
  ASSERT_EQ(two_bytes.size(), 2u) << log;
  EXPECT_TRUE(absl::StrContains(log, "(2 ranks)")) << log;
  EXPECT_FALSE(absl::StrContains(log, "dropped")) << log;
  auto loaded = server::CheckpointStore(ckpt, 1).LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  double parameters = 0;
  for (const std::string& layer : loaded->checkpoint.layer_params()) {
    parameters += layer.size() / sizeof(float);
  }
  const double fp32_bytes = kVersions * parameters * sizeof(float);
  const double node_bytes = two_bytes[0] + two_bytes[1];
  std::printf(
      "final held-out loss: one process %.4f, 2-rank node %.4f (%+.2f%%); pushed bytes: one "
      "process %.0f, node %.0f (%.0f + %.0f, %.3fx), float32 would be %.0f (%.1fx)\n",
      one_loss, two_loss, 100 * (two_loss - one_loss) / one_loss, one_bytes[0], node_bytes,
      two_bytes[0], two_bytes[1], node_bytes / one_bytes[0], fp32_bytes, fp32_bytes / node_bytes);
  EXPECT_LT(two_loss, 4.0) << "the node did not train (ln 256 = 5.55 at the start)";
  // The node's factors are one process's up to the order of the all-reduce's sums and where
  // P's int4 blocks start: the runs end together. (Warm starts read from freed memory once made
  // the node's runs spread by -2% to +4%.)
  EXPECT_LE(std::abs(two_loss - one_loss) / one_loss, 0.01);
  // Both ranks send Q of the one tensor per layer that the slice boundary cuts, and its cut row
  // in float32: 9% more than one process (whose float32 1-D tensors are a fifth of its bytes).
  EXPECT_LE(node_bytes, 1.12 * one_bytes[0]);
  EXPECT_GE(fp32_bytes / node_bytes, 14.0);
}

// With overlapped rounds a node's push runs on a background thread beside the next round's
// training: the ranks compute the factors over the control process group, never the trainer's.
// Every round is pushed and applied, none dropped.
TEST_F(FsdpWorkerTest, OverlappedRoundsOfATwoRankNodeComputeTheFactorsOnTheControlGroup) {
  const int port = StartServer(
      absl::StrCat("local_steps: 12\nmax_versions: 6\n",
                   "aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }\n",
                   LowRankInt4Transport()));
  ASSERT_GT(port, 0);
  auto node = StartWorker(port, "trainer", 0, 1.0, {"--nproc=2", "--overlap=delayed"});
  EXPECT_EQ(server_->Wait(absl::Seconds(180)), std::optional<int>(0)) << Logs();
  EXPECT_EQ(node->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  const std::string summary = ReadFile(dir_ + "/summary");
  EXPECT_TRUE(absl::StrContains(summary, "version=6")) << summary << Logs();
  const std::string log = ReadFile(dir_ + "/trainer0.log");
  EXPECT_FALSE(absl::StrContains(log, "dropped")) << log;
  EXPECT_FALSE(absl::StrContains(log, "pushed without overlap")) << log;
}

// SIGTERM to the node's launcher reaches every rank: they agree to stop after the same step,
// push their slices of the partial round (merged and applied by the server), leave, exit 0.
TEST_F(FsdpWorkerTest, SigtermStopsEveryRankAfterTheSameStepAndThePartialRoundIsApplied) {
  const int port = StartServer("local_steps: 100000\naggregation { min_workers: 1 }\n");
  ASSERT_GT(port, 0);
  auto node = StartWorker(port, "trainer", 0, 1.0, {"--nproc=2"});
  const std::string log = dir_ + "/trainer0.log";
  for (int i = 0; i < 600 && !absl::StrContains(ReadFile(log), "(2 ranks)"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(absl::StrContains(ReadFile(log), "(2 ranks)")) << Logs();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  node->Signal(SIGTERM);
  ASSERT_EQ(node->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  const std::string text = ReadFile(log);
  EXPECT_TRUE(absl::StrContains(text, "stopping: pushing the")) << text;
  EXPECT_EQ(Scraped("aloe_model_version"), 1) << Logs();
  EXPECT_EQ(Scraped("aloe_updates_applied_total"), 1) << Logs();
  EXPECT_EQ(Scraped("aloe_workers_left_total"), 1) << Logs();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
}

// On a GPU (skipped unless aloe-worker can train on cuda:0 here: a build against a CUDA LibTorch
// on a machine with a GPU; aloe-bench-worker, with the same trainer and device choice, is asked):
// the 3-round job with the worker on the GPU, pulling and pushing through host memory, ends
// where the same job with a CPU worker ends, up to float summation order.
TEST_F(FsdpWorkerTest, AGpuWorkerTrainsLikeACpuWorker) {
  const std::string probe =
      Bin("aloe-bench-worker") +
      " --device=cuda:0 --steps=1 --warmup=0 --vocab_size=16 --seq_len=8 --d_model=16 "
      "--num_layers=1 --num_heads=2 --batch_size=1 >/dev/null 2>&1";
  if (std::system(probe.c_str()) != 0) {
    GTEST_SKIP() << "aloe-worker cannot train on cuda:0 here (no GPU, or a CPU-only LibTorch)";
  }
  const std::vector<float> cpu = RunJob("cpu", {});
  const std::vector<float> gpu = RunJob("gpu", {"--device=cuda:0"});
  ASSERT_FALSE(cpu.empty());
  ASSERT_EQ(cpu.size(), gpu.size());
  EXPECT_TRUE(absl::StrContains(logs_["gpu"], "training on cuda:0")) << logs_["gpu"];
  const double relative = RelativeError(gpu, cpu);
  std::printf("GPU worker vs CPU worker after 3 rounds: relative error %.3g\n", relative);
  EXPECT_LE(relative, 1e-3) << logs_["gpu"];
}

// --device is checked before the worker joins, with the flag named: an unknown device, a GPU
// that this build or machine does not have (no machine here has 64), and a fixed GPU for a node
// whose ranks each take one. A worker that trains says where ("training on cpu" here).
TEST_F(FsdpWorkerTest, DeviceFlagIsCheckedBeforeJoiningAndTheDeviceIsLogged) {
  const int port = StartServer("local_steps: 2\nmax_versions: 1\n");
  ASSERT_GT(port, 0);
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--device=gpu"}, "--device must be cpu, cuda, cuda:I or auto, got \"gpu\""},
      {{"--device=cuda:63"}, "--device cuda:63: "},
      {{"--nproc=2", "--device=cuda:1"}, "--device cuda:I is for one-process workers"},
  };
  int index = 0;
  for (const auto& [flags, message] : refused) {
    auto worker = StartWorker(port, "trainer", index, 1.0, flags);
    EXPECT_EQ(worker->Wait(absl::Seconds(60)), std::optional<int>(1)) << message;
    const std::string log = ReadFile(absl::StrCat(dir_, "/trainer", index, ".log"));
    EXPECT_TRUE(absl::StrContains(log, message)) << log;
    EXPECT_FALSE(absl::StrContains(log, "joined as worker")) << log;
    ++index;
  }
  auto worker = StartWorker(port, "trainer", index, 1.0, {"--device=cpu"});
  EXPECT_EQ(worker->Wait(absl::Seconds(120)), std::optional<int>(0)) << Logs();
  EXPECT_TRUE(
      absl::StrContains(ReadFile(absl::StrCat(dir_, "/trainer", index, ".log")), "training on cpu"))
      << Logs();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(absl::Seconds(30)), std::optional<int>(0)) << Logs();
}

}  // namespace
}  // namespace aloe
