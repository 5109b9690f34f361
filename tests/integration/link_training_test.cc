// A short real training job across an emulated long link (tools/link_emulator.h): aloe-server
// and an aloe-worker process whose every connection to the server crosses 50 ms of one-way delay
// at 100 Mbit/s, the server's receive windows probed as operations.md advises for long links.
// The job must end at the version its stop condition names, with every push and pull having
// crossed the link.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "tests/integration/loopback_cluster.h"
#include "tests/testing/subprocess.h"
#include "tools/link_emulator.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::LoopbackTest;
using ::aloe::testing::ReadFile;

TEST_F(LoopbackTest, TrainsAShortJobThroughA50MsLinkToTheLastVersion) {
  constexpr int kVersions = 3;
  const int port = StartServer(absl::StrCat("local_steps: 4\nmax_versions: ", kVersions,
                                            "\naggregation { min_workers: 1 }\n",
                                            "receive_window_probe: true\n"));
  ASSERT_GT(port, 0);
  tools::LinkEmulatorOptions options;
  options.routes.push_back({"127.0.0.1:0", absl::StrCat("127.0.0.1:", port)});
  options.up.delay = absl::Milliseconds(50);
  options.up.rate_bps = 100e6;
  options.down = options.up;
  absl::StatusOr<std::unique_ptr<tools::LinkEmulator>> link = tools::LinkEmulator::Start(options);
  ASSERT_THAT(link.status(), IsOk());

  const absl::Time start = absl::Now();
  auto worker = StartWorker((*link)->port(0), "trainer", 0);
  ASSERT_EQ(server_->Wait(absl::Seconds(240)), std::optional<int>(0)) << Logs();
  EXPECT_EQ(worker->Wait(absl::Seconds(60)), std::optional<int>(0)) << Logs();
  const absl::Duration took = absl::Now() - start;

  const std::string summary = ReadFile(dir_ + "/summary");
  EXPECT_NE(summary.find(absl::StrCat("version=", kVersions, "\n")), std::string::npos)
      << summary << Logs();
  EXPECT_NE(summary.find(absl::StrCat("updates_applied=", kVersions, "\n")), std::string::npos)
      << summary;
  // Every push went up the link and every version came down it: an fp32 update a round, and at
  // least the first pull.
  v1::TransformerConfig model;
  model.set_vocab_size(256);
  model.set_seq_len(32);
  model.set_d_model(64);
  model.set_num_layers(2);
  model.set_num_heads(2);
  FillTransformerDefaults(&model);
  const double model_bytes = 4 * TransformerParameters(model);
  const tools::LinkStats stats = (*link)->Stats();
  EXPECT_GE(stats.up_bytes, kVersions * model_bytes);
  EXPECT_GE(stats.down_bytes, model_bytes);
  // Join, task, pull and push each wait for at least one round trip of 100 ms.
  EXPECT_GE(took, absl::Milliseconds(4 * 100 * kVersions));
}

}  // namespace
}  // namespace aloe
