// Low-rank pushes end to end (paper 001): the deterministic single-trainer job of
// codec_test.cc with fp32 pushes and with every layer pushed as rank-16 factors in int8 or int4
// plus error feedback, through a real server and worker; the final held-out losses and the
// pushed bytes are compared.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/core/checkpoint_store.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

// The value of `key`=N in a worker's closing summary; -1 when absent.
double SummaryValue(const std::string& log, const std::string& key) {
  const size_t at = log.rfind(key + "=");
  double value = -1;
  if (at != std::string::npos) {
    const size_t from = at + key.size() + 1;
    absl::SimpleAtod(log.substr(from, log.find_first_of(" \n", from) - from), &value);
  }
  return value;
}

// transport {} with error feedback and every layer pushed as rank-`rank` factors in
// `factor_codec`.
std::string LowRankTransport(int rank, const std::string& factor_codec) {
  std::string transport =
      "transport { error_feedback: true int8_block_size: 256 int4_block_size: 64";
  for (const char* layer : {"embed", "blocks.0", "blocks.1", "head"}) {
    absl::StrAppend(&transport, " layer_codecs { layer: \"", layer,
                    "\" codec: CODEC_LOWRANK rank: ", rank, " factor_codec: ", factor_codec, " }");
  }
  return transport + " }\n";
}

TEST_F(LoopbackTest,
       LowRankWithInt4FactorsAndErrorFeedbackEndsWithinThreePercentOfFp32WithASixteenthOfTheBytes) {
  const std::string config = "local_steps: 12\nmax_versions: 8\n";
  RunSingleTrainerJob("fp32", config, {}, /*evaluate=*/true);
  const double fp32_loss = FinalEvalLoss();
  const double fp32_bytes = SummaryValue(ReadFile(dir_ + "/fp32.log"), "pushed_bytes");
  EXPECT_LT(fp32_loss, 4.0) << "the job did not train (ln 256 = 5.55 at the start)";
  struct Case {
    std::string factor_codec;
    double max_loss_increase;  // relative to fp32's final held-out loss
    double min_ratio;          // fp32 bytes over low-rank bytes
  };
  // The 64-wide model keeps its 1-D tensors (1.3% of its values) in float32, and rank 16 is a
  // quarter of its width: a matrix's factors, (m + n) r values instead of m n, are between a
  // quarter and a half of it, then 1 byte (int8, and a scale per 256) or half a byte (int4, and
  // a scale per 64) each. The int4
  // case is paper 001's combination, and its targets: 16x fewer bytes, within 3% of fp32.
  for (const Case& c :
       {Case{"CODEC_INT8_BLOCKWISE", 0.05, 10.0}, Case{"CODEC_INT4_BLOCKWISE", 0.03, 16.0}}) {
    SCOPED_TRACE(c.factor_codec);
    const std::string name = "lowrank_" + c.factor_codec;
    RunSingleTrainerJob(name, config + LowRankTransport(16, c.factor_codec), {},
                        /*evaluate=*/true);
    const double loss = FinalEvalLoss();
    const double bytes = SummaryValue(ReadFile(dir_ + "/" + name + ".log"), "pushed_bytes");
    std::printf(
        "final held-out loss: fp32 %.4f, low-rank 16 + %s + EF %.4f (%+.2f%%); pushed bytes: "
        "fp32 %.0f, low-rank %.0f (%.2fx fewer)\n",
        fp32_loss, c.factor_codec.c_str(), loss, 100 * (loss - fp32_loss) / fp32_loss, fp32_bytes,
        bytes, fp32_bytes / bytes);
    EXPECT_LE((loss - fp32_loss) / fp32_loss, c.max_loss_increase);
    ASSERT_GT(bytes, 0);
    EXPECT_GE(fp32_bytes / bytes, c.min_ratio);
  }
}

// Paper 001 Alg. 3 through a real server and worker: the worker reports each tensor's effective
// rank with its pushes, the server keeps the windows (in its checkpoint), and the next tasks
// compress at the ranks and run the local steps they give.
TEST_F(LoopbackTest, AdaptiveRankFollowsTheObservedRanksThroughARealServer) {
  std::string transport = LowRankTransport(16, "CODEC_INT4_BLOCKWISE");
  transport.insert(transport.rfind('}'),
                   "adaptive_rank { enabled: true window: 3 adapt_local_steps: true } ");
  const std::string ckpt = RunSingleTrainerJob(
      "adaptive", "local_steps: 12\nmax_versions: 8\n" + transport, {}, /*evaluate=*/true);
  const double loss = FinalEvalLoss();
  const std::string log = ReadFile(dir_ + "/adaptive.log");
  std::printf(
      "adaptive rank: final held-out loss %.4f, pushed bytes %.0f, local steps %.0f in all\n", loss,
      SummaryValue(log, "pushed_bytes"), SummaryValue(log, "steps"));
  EXPECT_LT(loss, 4.0) << "the job did not train (ln 256 = 5.55 at the start)";
  auto loaded = server::CheckpointStore(ckpt, 1).LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const v1::ServerCheckpoint& c = loaded->checkpoint;
  // 64-wide model, 2 blocks: the 2-D tensors are embed's 2, head's 1 and 4 per block.
  ASSERT_EQ(c.adaptive_ranks_size(), 2 + 1 + 2 * 4);
  int moved = 0;
  for (const v1::AdaptiveRankWindow& w : c.adaptive_ranks()) {
    ASSERT_EQ(w.effective_ranks_size(), 3) << "layer " << w.layer() << " tensor " << w.tensor();
    std::string window;
    for (uint32_t r : w.effective_ranks()) {
      absl::StrAppend(&window, " ", r);
      EXPECT_LE(r, 2u * 64u);
      if (r != 16) ++moved;
    }
    std::printf("layer %u tensor %u: effective ranks%s\n", w.layer(), w.tensor(), window.c_str());
  }
  EXPECT_GT(moved, 0) << "no tensor's rank moved off the configured 16";
}

}  // namespace
}  // namespace aloe
