// Push compression end to end: the same deterministic job (one trainer, sync rounds, fixed
// seeds) with fp32 pushes and with int8 or int4 blockwise pushes plus error feedback; the final
// models' held-out losses (measured by an evaluator that joined the job) agree with fp32's
// within a tolerance, and the compressed pushes carry a quarter (int8) or about a sixth (int4
// in blocks of 32) of the bytes.
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

// The final held-out losses and pushed bytes of the job with fp32 pushes and with `transport`.
struct Comparison {
  double fp32_loss = 0;
  double loss = 0;
  double fp32_bytes = 0;
  double bytes = 0;
  double RelativeLossChange() const { return (loss - fp32_loss) / fp32_loss; }
  double BytesRatio() const { return fp32_bytes / bytes; }
};

class CodecTest : public LoopbackTest {
 protected:
  // Runs the job with fp32 pushes, then as `name` with `transport` (a TransportConfig text).
  Comparison CompareWithFp32(const std::string& name, const std::string& transport) {
    const std::string config = "local_steps: 12\nmax_versions: 8\n";
    Comparison c;
    RunSingleTrainerJob("fp32", config, {}, /*evaluate=*/true);
    c.fp32_loss = FinalEvalLoss();
    RunSingleTrainerJob(name, config + "transport { " + transport + " }\n", {},
                        /*evaluate=*/true);
    c.loss = FinalEvalLoss();
    c.fp32_bytes = PushedBytes(ReadFile(dir_ + "/fp32.log"));
    c.bytes = PushedBytes(ReadFile(dir_ + "/" + name + ".log"));
    std::printf(
        "final held-out loss: fp32 %.4f, %s %.4f (%+.2f%%); pushed bytes: fp32 %.0f, %s %.0f "
        "(%.2fx fewer)\n",
        c.fp32_loss, name.c_str(), c.loss, 100 * c.RelativeLossChange(), c.fp32_bytes, name.c_str(),
        c.bytes, c.BytesRatio());
    EXPECT_LT(c.fp32_loss, 4.0) << "the job did not train (ln 256 = 5.55 at the start)";
    EXPECT_GT(c.bytes, 0);
    return c;
  }
};

TEST_F(CodecTest, Int8WithErrorFeedbackEndsWithinTwoPercentOfFp32WithAQuarterOfTheBytes) {
  const Comparison c = CompareWithFp32(
      "int8", "codec: CODEC_INT8_BLOCKWISE int8_block_size: 256 error_feedback: true");
  EXPECT_LE(std::fabs(c.RelativeLossChange()), 0.02);
  EXPECT_GE(c.BytesRatio(), 3.8);  // int8 + one fp32 scale per 256 values: ~3.94x
  EXPECT_LE(c.BytesRatio(), 4.0);
}

TEST_F(CodecTest, Int4WithErrorFeedbackEndsWithinThreePercentOfFp32WithASixthOfTheBytes) {
  // Blocks of 32, not the default 64: the byte ratio then also shows that the worker took the
  // block size from the config.
  const Comparison c = CompareWithFp32(
      "int4", "codec: CODEC_INT4_BLOCKWISE int4_block_size: 32 error_feedback: true");
  EXPECT_LE(std::fabs(c.RelativeLossChange()), 0.03);
  EXPECT_GE(c.BytesRatio(), 6.3);  // 4 bits + one fp32 scale per 32 values: 6.4x
  EXPECT_LE(c.BytesRatio(), 6.4);
}

}  // namespace
}  // namespace aloe
