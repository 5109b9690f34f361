// Low-rank pushes end to end (paper 001): the deterministic single-trainer job of
// codec_test.cc with fp32 pushes and with every layer pushed as rank-16 factors in int8 plus
// error feedback, through a real server and worker; the final held-out losses and the pushed
// bytes are compared.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

TEST_F(LoopbackTest, LowRankInt8WithErrorFeedbackStaysNearFp32WithATenthOfTheBytes) {
  const std::string config = "local_steps: 12\nmax_versions: 8\n";
  std::string low_rank = "transport { error_feedback: true int8_block_size: 256";
  for (const char* layer : {"embed", "blocks.0", "blocks.1", "head"}) {
    absl::StrAppend(&low_rank, " layer_codecs { layer: \"", layer,
                    "\" codec: CODEC_LOWRANK rank: 16 factor_codec: CODEC_INT8_BLOCKWISE }");
  }
  low_rank += " }\n";
  RunSingleTrainerJob("fp32", config, {}, /*evaluate=*/true);
  const double fp32_loss = FinalEvalLoss();
  RunSingleTrainerJob("lowrank", config + low_rank, {}, /*evaluate=*/true);
  const double low_rank_loss = FinalEvalLoss();
  const double fp32_bytes = SummaryValue(ReadFile(dir_ + "/fp32.log"), "pushed_bytes");
  const double low_rank_bytes = SummaryValue(ReadFile(dir_ + "/lowrank.log"), "pushed_bytes");
  std::printf(
      "final held-out loss: fp32 %.4f, low-rank 16 + int8 + EF %.4f (%+.2f%%); pushed bytes: "
      "fp32 %.0f, low-rank %.0f (%.2fx fewer)\n",
      fp32_loss, low_rank_loss, 100 * (low_rank_loss - fp32_loss) / fp32_loss, fp32_bytes,
      low_rank_bytes, fp32_bytes / low_rank_bytes);
  EXPECT_LT(fp32_loss, 4.0) << "the job did not train (ln 256 = 5.55 at the start)";
  EXPECT_LE((low_rank_loss - fp32_loss) / fp32_loss, 0.05);
  ASSERT_GT(low_rank_bytes, 0);
  EXPECT_GE(fp32_bytes / low_rank_bytes, 10.0);
}

}  // namespace
}  // namespace aloe
