// Push compression end to end: the same deterministic job (one trainer, sync rounds, fixed
// seeds) with fp32 pushes and with int8 blockwise pushes plus error feedback; the final models'
// held-out losses (measured by an evaluator that joined the job) agree within 2%,
// and the int8 pushes carry about a quarter of the bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"

namespace aloe {
namespace {

using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

// pushed_bytes=N from a worker's closing summary; -1 when absent.
double PushedBytes(const std::string& log) {
  const size_t at = log.find("pushed_bytes=");
  double bytes = -1;
  if (at != std::string::npos) {
    absl::SimpleAtod(log.substr(at + 13, log.find_first_of(" \n", at) - at - 13), &bytes);
  }
  return bytes;
}

TEST_F(LoopbackTest, Int8WithErrorFeedbackEndsWithinTwoPercentOfFp32WithAQuarterOfTheBytes) {
  const std::string config = "local_steps: 12\nmax_versions: 8\n";
  const std::string int8_config =
      config +
      "transport { codec: CODEC_INT8_BLOCKWISE int8_block_size: 256 error_feedback: true }\n";
  RunSingleTrainerJob("fp32", config, {}, /*evaluate=*/true);
  const double fp32_loss = FinalEvalLoss();
  RunSingleTrainerJob("int8", int8_config, {}, /*evaluate=*/true);
  const double int8_loss = FinalEvalLoss();
  const double fp32_bytes = PushedBytes(ReadFile(dir_ + "/fp32.log"));
  const double int8_bytes = PushedBytes(ReadFile(dir_ + "/int8.log"));
  std::printf(
      "final held-out loss: fp32 %.4f, int8+EF %.4f (%+.2f%%); pushed bytes: fp32 %.0f, "
      "int8+EF %.0f (%.2fx fewer)\n",
      fp32_loss, int8_loss, 100 * (int8_loss - fp32_loss) / fp32_loss, fp32_bytes, int8_bytes,
      fp32_bytes / int8_bytes);
  EXPECT_LT(fp32_loss, 4.0) << "the job did not train (ln 256 = 5.55 at the start)";
  EXPECT_LE(std::fabs(int8_loss - fp32_loss) / fp32_loss, 0.02);
  ASSERT_GT(int8_bytes, 0);
  EXPECT_GE(fp32_bytes / int8_bytes, 3.8);  // int8 + one fp32 scale per 256 values: ~3.94x
  EXPECT_LE(fp32_bytes / int8_bytes, 4.0);
}

}  // namespace
}  // namespace aloe
