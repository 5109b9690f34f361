// AppliedReporter against a fake coordinator served over real gRPC on loopback: a burst of
// versions ends with the newest reported, an unchanged version is sent again every period (for
// a coordinator that restarted), a failing coordinator is retried at the period and not in a
// busy loop, and the shard's token and index go with every call.
#include "server/service/applied_reporter.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "proto/aloe.grpc.pb.h"
#include "server/service/auth.h"
#include "tests/testing/loopback_server.h"

namespace aloe::server {
namespace {

class FakeShardControl final : public v1::ShardControl::Service {
 public:
  grpc::Status ReportApplied(grpc::ServerContext* context, const v1::AppliedReport* report,
                             v1::AppliedAck*) override {
    absl::MutexLock lock(&mu_);
    const auto token = context->client_metadata().find(kTokenMetadata);
    tokens_.push_back(token == context->client_metadata().end()
                          ? ""
                          : std::string(token->second.data(), token->second.size()));
    if (failures_left_ > 0) {
      --failures_left_;
      ++failed_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator restarts");
    }
    reports_.push_back(*report);
    return grpc::Status::OK;
  }

  void FailNext(int calls) {
    absl::MutexLock lock(&mu_);
    failures_left_ = calls;
  }
  std::vector<v1::AppliedReport> reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  std::vector<std::string> tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  int failed() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

 private:
  absl::Mutex mu_;
  int failures_left_ ABSL_GUARDED_BY(mu_) = 0;
  int failed_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::AppliedReport> reports_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
};

class AppliedReporterTest : public ::testing::Test {
 protected:
  AppliedReporterTest() : stub_(v1::ShardControl::NewStub(server_.Channel())) {}

  AppliedReporter::Options Options(absl::Duration period) {
    AppliedReporter::Options options;
    options.shard_index = 3;
    options.token = "secret";
    options.period = period;
    return options;
  }

  FakeShardControl fake_;
  ::aloe::testing::LoopbackServer server_{&fake_};
  std::unique_ptr<v1::ShardControl::Stub> stub_;
};

TEST_F(AppliedReporterTest, ABurstEndsWithTheNewestVersionReported) {
  AppliedReporter reporter(*stub_, Options(absl::Seconds(60)));
  EXPECT_EQ(reporter.reported(), std::nullopt);
  for (uint64_t v = 1; v <= 200; ++v) reporter.Set(v);
  ASSERT_TRUE(reporter.AwaitReported(200, absl::Seconds(10)));
  const std::vector<v1::AppliedReport> reports = fake_.reports();
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().version(), 200u);
  EXPECT_EQ(reports.back().shard_index(), 3u);
  // One call at a time, each with the newest version: far fewer calls than versions, in order.
  EXPECT_LT(reports.size(), 200u);
  for (size_t i = 1; i < reports.size(); ++i) {
    EXPECT_LT(reports[i - 1].version(), reports[i].version());
  }
  for (const std::string& token : fake_.tokens()) EXPECT_EQ(token, "secret");
}

TEST_F(AppliedReporterTest, AnUnchangedVersionIsSentAgainEveryPeriod) {
  AppliedReporter reporter(*stub_, Options(absl::Milliseconds(100)));
  reporter.Set(7);
  ASSERT_TRUE(reporter.AwaitReported(7, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(550));
  const std::vector<v1::AppliedReport> reports = fake_.reports();
  // The first call at once, then one per period: about 6 in 0.55 s.
  EXPECT_GE(reports.size(), 3u);
  EXPECT_LE(reports.size(), 8u);
  for (const v1::AppliedReport& r : reports) EXPECT_EQ(r.version(), 7u);
}

TEST_F(AppliedReporterTest, AFailingCoordinatorIsAskedAgainAtThePeriodNotInALoop) {
  fake_.FailNext(1000000);
  AppliedReporter reporter(*stub_, Options(absl::Milliseconds(200)));
  reporter.Set(5);
  absl::SleepFor(absl::Seconds(1));
  // About one call per period (5 in 1 s); a loop without the wait would make thousands.
  const int failed = fake_.failed();
  EXPECT_GE(failed, 2);
  EXPECT_LE(failed, 7);
  EXPECT_EQ(reporter.reported(), std::nullopt);
  fake_.FailNext(0);  // the coordinator is back
  reporter.Set(6);
  ASSERT_TRUE(reporter.AwaitReported(6, absl::Seconds(10)));
  EXPECT_EQ(fake_.reports().front().version(), 6u);
}

TEST_F(AppliedReporterTest, NothingIsSentBeforeTheFirstVersionAndStopIsPrompt) {
  const absl::Time start = absl::Now();
  {
    AppliedReporter reporter(*stub_, Options(absl::Milliseconds(50)));
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_TRUE(fake_.reports().empty());
  EXPECT_TRUE(fake_.tokens().empty());
}

}  // namespace
}  // namespace aloe::server
