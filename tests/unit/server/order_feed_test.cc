// The coordinator's Follow streams as whole calls, with a fake coordinator (order log, restore,
// addresses) and recorded waits instead of sockets and a clock. Several processes' streams run
// in one thread: where a stream would block (waiting for the others, or for the next order), a
// hook runs the other process's call, as the other thread would.
#include "server/core/order_feed.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::_;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

constexpr char kFingerprint[] = "sharded1;test";

v1::ShardOrder Order(v1::ShardOrder::Kind kind, uint64_t version) {
  v1::ShardOrder order;
  order.set_kind(kind);
  order.set_version(version);
  return order;
}

v1::FollowRequest Request(uint32_t shard, uint64_t version, bool fresh,
                          std::vector<uint64_t> checkpoints = {}) {
  v1::FollowRequest request;
  request.set_shard_index(shard);
  request.set_version(version);
  request.set_fresh(fresh);
  request.set_fingerprint(kFingerprint);
  request.set_address("10.0.0." + std::to_string(shard) + ":7001");
  request.set_push_address("10.0.0." + std::to_string(shard) + ":7101");
  for (uint64_t v : checkpoints) request.add_checkpoint_versions(v);
  return request;
}

// What a stream was sent, as "KIND version" strings.
class RecordingSink final : public OrderSink {
 public:
  bool Write(const v1::ShardOrder& order) override {
    sent.push_back(v1::ShardOrder::Kind_Name(order.kind()) + " " + std::to_string(order.version()));
    keep.push_back(
        std::vector<uint64_t>(order.keep_versions().begin(), order.keep_versions().end()));
    return true;
  }
  bool Cancelled() override { return cancelled; }

  std::vector<std::string> sent;
  std::vector<std::vector<uint64_t>> keep;
  bool cancelled = false;
};

// A coordinator whose order log is a vector of COMMITs; a restore empties it, as a new core's.
class FakeHost final : public FeedHost {
 public:
  uint64_t version() override { return core_version; }
  std::vector<uint64_t> RestartVersions() override { return restart_versions; }
  absl::Status Restore(uint64_t version) override {
    restores.push_back(version);
    if (!restore_status.ok()) return std::exchange(restore_status, absl::OkStatus());
    core_version = version;
    log.clear();
    return absl::OkStatus();
  }
  void SetAddresses(const std::vector<ShardAddress>& told) override {
    for (const ShardAddress& a : told) addresses.emplace_back(a.shard, a.address);
  }
  void Assembled(uint64_t version) override { assembled.push_back(version); }
  std::optional<uint64_t> OrderIndexAfter(uint64_t) override { return index_after; }
  std::vector<v1::ShardOrder> OrdersFrom(uint64_t cursor) override {
    std::vector<v1::ShardOrder> batch;
    for (uint64_t i = cursor; i < log.size(); ++i) {
      batch.push_back(log[i]);
      for (uint64_t v : keep) batch.back().add_keep_versions(v);
    }
    return batch;
  }
  void TrimOrdersBefore(uint64_t index) override { trims.push_back(index); }
  void WaitForOrder(uint64_t cursor, absl::Duration) override {
    order_waits.push_back(cursor);
    if (on_wait) on_wait();
  }

  // Appends COMMITs up to `version`.
  void CommitUpTo(uint64_t version) {
    while (core_version < version) log.push_back(Order(v1::ShardOrder::COMMIT, ++core_version));
  }

  uint64_t core_version = 0;
  std::vector<uint64_t> restart_versions = {0};
  absl::Status restore_status;
  std::optional<uint64_t> index_after;
  std::vector<v1::ShardOrder> log;
  std::vector<uint64_t> keep;
  std::vector<uint64_t> restores;
  std::vector<uint64_t> assembled;
  std::vector<std::pair<uint32_t, std::string>> addresses;
  std::vector<uint64_t> trims;
  std::vector<uint64_t> order_waits;  // the cursor of each wait for an order
  std::function<void()> on_wait;
};

// Releases the lock around a hook, as a condition variable wait would.
class HookedWaits final : public FeedWaits {
 public:
  void Wait(absl::Mutex& mu, absl::Duration timeout) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    timeouts.push_back(timeout);
    mu.Unlock();
    if (on_wait) on_wait();
    mu.Lock();
  }
  void WakeAll() override { ++wakes; }

  std::vector<absl::Duration> timeouts;
  std::function<void()> on_wait;
  int wakes = 0;
};

class OrderFeedTest : public ::testing::Test {
 protected:
  // A feed of `processes` shard processes.
  OrderFeed& Feed(uint32_t processes) {
    OrderFeed::Options options;
    options.shard_processes = processes;
    options.fingerprint = kFingerprint;
    feed_ = std::make_unique<OrderFeed>(options, host, waits, clock);
    return *feed_;
  }
  // The lone shard process joins a fresh feed; its stream ends (cancelled) at its first wait.
  OrderFeed& AssembledAlone() {
    OrderFeed& feed = Feed(1);
    RecordingSink sink;
    host.on_wait = [&] { sink.cancelled = true; };
    EXPECT_THAT(feed.Serve(Request(0, 0, true), sink), StatusIs(absl::StatusCode::kCancelled, _));
    EXPECT_THAT(sink.sent, ElementsAre("RESTORE 0"));
    host.on_wait = nullptr;
    return feed;
  }

  FakeHost host;
  HookedWaits waits;
  FakeClock clock;
  std::unique_ptr<OrderFeed> feed_;
};

TEST_F(OrderFeedTest, ALoneProcessGetsRestoreThenTheLogThenFinish) {
  OrderFeed& feed = Feed(1);
  host.keep = {1};
  RecordingSink sink;
  int order_waits = 0;
  host.on_wait = [&] {
    if (++order_waits == 1) {
      host.CommitUpTo(2);
    } else {
      EXPECT_EQ(feed.Finish(2, absl::ZeroDuration()), 0u);  // not sent yet
    }
  };

  EXPECT_THAT(feed.Serve(Request(0, 0, true), sink), IsOk());

  EXPECT_THAT(sink.sent, ElementsAre("RESTORE 0", "COMMIT 1", "COMMIT 2", "FINISH 2"));
  EXPECT_THAT(sink.keep[1], ElementsAre(1u));  // COMMITs carry the versions to keep
  EXPECT_TRUE(host.restores.empty());          // the first assembly at the coordinator's version
  EXPECT_THAT(host.assembled, ElementsAre(0u));
  EXPECT_THAT(host.addresses, ElementsAre(Pair(0u, "10.0.0.0:7001")));
  EXPECT_THAT(host.order_waits, ElementsAre(0u, 2u));
  EXPECT_TRUE(feed.ready());
  EXPECT_EQ(feed.epoch(), 1u);
  EXPECT_EQ(feed.Finish(2, absl::ZeroDuration()), 1u);
}

TEST_F(OrderFeedTest, TwoProcessesWaitForEachOtherAndBothStartAtTheChosenVersion) {
  OrderFeed& feed = Feed(2);
  host.restart_versions = {4, 2};
  host.core_version = 4;
  RecordingSink sink0, sink1;
  absl::Status status1;
  // Shard process 0 waits for the assembly; meanwhile process 1 joins (and is then cancelled at
  // its first wait for an order, as is process 0).
  waits.on_wait = [&] {
    host.on_wait = [&] { sink1.cancelled = true; };
    status1 = feed.Serve(Request(1, 2, false, {2}), sink1);
    host.on_wait = [&] { sink0.cancelled = true; };
  };

  EXPECT_THAT(feed.Serve(Request(0, 0, true, {2, 1}), sink0),
              StatusIs(absl::StatusCode::kCancelled, _));

  EXPECT_THAT(status1, StatusIs(absl::StatusCode::kCancelled, _));
  // The newest version everybody can be at is 2: the coordinator goes back to it.
  EXPECT_THAT(host.restores, ElementsAre(2u));
  EXPECT_THAT(host.assembled, ElementsAre(2u));
  EXPECT_THAT(sink0.sent, ElementsAre("RESTORE 2"));
  EXPECT_THAT(sink1.sent, ElementsAre("RESTORE 2"));
  EXPECT_THAT(waits.timeouts, ElementsAre(absl::Milliseconds(200)));
  EXPECT_THAT(host.addresses, ElementsAre(Pair(0u, "10.0.0.0:7001"), Pair(1u, "10.0.0.1:7001")));
  EXPECT_TRUE(feed.ready());
}

TEST_F(OrderFeedTest, AProcessThatLostItsConnectionFollowsOnWithoutRestore) {
  OrderFeed& feed = AssembledAlone();
  host.CommitUpTo(3);
  host.index_after = 1;  // the process is at version 1: COMMIT 2 is at index 1
  RecordingSink sink;
  host.on_wait = [&] { feed.Finish(3, absl::ZeroDuration()); };

  EXPECT_THAT(feed.Serve(Request(0, 1, false), sink), IsOk());

  EXPECT_THAT(sink.sent, ElementsAre("COMMIT 2", "COMMIT 3", "FINISH 3"));
  EXPECT_TRUE(host.restores.empty());
  EXPECT_THAT(host.assembled, ElementsAre(0u));  // no new assembly
  EXPECT_EQ(feed.epoch(), 1u);
}

TEST_F(OrderFeedTest, ARestartedProcessReassemblesAtTheNewestCommonCheckpoint) {
  OrderFeed& feed = AssembledAlone();
  host.CommitUpTo(5);
  host.restart_versions = {5, 4, 2};
  host.index_after = 5;  // would follow on, but it restarted
  RecordingSink sink;
  host.on_wait = [&] { sink.cancelled = true; };

  EXPECT_THAT(feed.Serve(Request(0, 1, /*fresh=*/true, {2, 1}), sink),
              StatusIs(absl::StatusCode::kCancelled, _));

  EXPECT_THAT(host.restores, ElementsAre(2u));
  EXPECT_THAT(host.assembled, ElementsAre(0u, 2u));
  EXPECT_THAT(sink.sent, ElementsAre("RESTORE 2"));  // the log after the restore is empty
  EXPECT_EQ(feed.epoch(), 2u);
  // Unknown while reassembling, then told again.
  EXPECT_THAT(host.addresses,
              ElementsAre(Pair(0u, "10.0.0.0:7001"), Pair(0u, ""), Pair(0u, "10.0.0.0:7001")));
}

TEST_F(OrderFeedTest, AFailedRestoreStartsTheAssemblyOver) {
  OrderFeed& feed = AssembledAlone();
  host.CommitUpTo(3);
  host.restart_versions = {3, 2};
  host.restore_status = absl::DataLossError("checkpoint unreadable");
  RecordingSink sink;

  EXPECT_THAT(feed.Serve(Request(0, 2, true, {2}), sink),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("reassembling")));

  EXPECT_THAT(host.restores, ElementsAre(2u));
  EXPECT_THAT(host.assembled, ElementsAre(0u));
  EXPECT_TRUE(sink.sent.empty());
  EXPECT_EQ(feed.epoch(), 3u);  // begun for the restart, and again for the failed restore
  EXPECT_FALSE(feed.ready());
}

TEST_F(OrderFeedTest, ANewerConnectionOfTheSameProcessEndsTheOlderStream) {
  OrderFeed& feed = AssembledAlone();
  host.index_after = 0;
  RecordingSink older, newer;
  absl::Status newer_status;
  int order_waits = 0;
  host.on_wait = [&] {
    if (++order_waits == 1) {
      newer_status = feed.Serve(Request(0, 0, false), newer);  // the older stream waits
    } else {
      newer.cancelled = true;
    }
  };

  EXPECT_THAT(feed.Serve(Request(0, 0, false), older),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("follow again")));

  EXPECT_THAT(newer_status, StatusIs(absl::StatusCode::kCancelled, _));
  EXPECT_EQ(feed.epoch(), 1u);  // a new connection, not a new assembly
  EXPECT_TRUE(feed.ready());
}

TEST_F(OrderFeedTest, ARestartEndsTheOtherProcessesStreamsAndClearsTheAddresses) {
  OrderFeed& feed = Feed(2);
  RecordingSink first0, first1;
  waits.on_wait = [&] {
    host.on_wait = [&] { first1.cancelled = true; };
    feed.Serve(Request(1, 0, true), first1).IgnoreError();
    host.on_wait = [&] { first0.cancelled = true; };
  };
  feed.Serve(Request(0, 0, true), first0).IgnoreError();
  ASSERT_TRUE(feed.ready());
  host.addresses.clear();

  // Process 0 follows on; while it waits for orders, process 1 restarts and waits for process 0
  // to join the new assembly (it is cancelled there).
  host.index_after = 0;
  RecordingSink follower0, restarted1;
  absl::Status restarted_status;
  int order_waits = 0;
  host.on_wait = [&] {
    if (++order_waits > 1) return;
    waits.on_wait = [&] { restarted1.cancelled = true; };
    restarted_status = feed.Serve(Request(1, 0, true), restarted1);
  };

  EXPECT_THAT(feed.Serve(Request(0, 0, false), follower0), StatusIs(absl::StatusCode::kAborted, _));

  EXPECT_THAT(restarted_status, StatusIs(absl::StatusCode::kAborted, _));
  EXPECT_EQ(feed.epoch(), 2u);
  EXPECT_FALSE(feed.ready());
  EXPECT_THAT(host.addresses, ElementsAre(Pair(0u, "10.0.0.0:7001"), Pair(0u, ""), Pair(1u, "")));
}

TEST_F(OrderFeedTest, TheLogIsTrimmedOnceTheSlowestProcessIsTwoSlacksIn) {
  OrderFeed& feed = AssembledAlone();
  host.index_after = 0;
  for (uint64_t i = 0; i < 2 * ShardAssembly::kLogSlack; ++i) {
    host.log.push_back(Order(v1::ShardOrder::DISCARD, 0));
  }
  RecordingSink sink;
  host.on_wait = [&] { sink.cancelled = true; };

  feed.Serve(Request(0, 0, false), sink).IgnoreError();

  EXPECT_EQ(sink.sent.size(), 2 * ShardAssembly::kLogSlack);
  EXPECT_THAT(host.trims, ElementsAre(ShardAssembly::kLogSlack));
}

TEST_F(OrderFeedTest, RequestsOfAnotherServerAreRefusedAndChangeNothing) {
  OrderFeed& feed = Feed(2);
  RecordingSink sink;
  v1::FollowRequest out_of_range = Request(2, 0, true);
  v1::FollowRequest other = Request(0, 0, true);
  other.set_fingerprint("sharded1;another");
  v1::FollowRequest nowhere = Request(1, 0, true);
  nowhere.clear_address();

  EXPECT_THAT(feed.Serve(out_of_range, sink),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has 2 shard processes")));
  EXPECT_THAT(feed.Serve(other, sink), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                HasSubstr("start every process with the same")));
  EXPECT_THAT(feed.Serve(nowhere, sink),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("address")));

  EXPECT_TRUE(sink.sent.empty());
  EXPECT_TRUE(host.addresses.empty());
  EXPECT_TRUE(waits.timeouts.empty());
  EXPECT_EQ(feed.epoch(), 1u);
}

TEST_F(OrderFeedTest, FinishWaitsUntilItsTimeoutOnTheInjectedClock) {
  OrderFeed& feed = Feed(2);
  waits.on_wait = [&] { clock.Advance(absl::Milliseconds(700)); };

  EXPECT_EQ(feed.Finish(3, absl::Seconds(1)), 0u);

  // 1 s, then the 300 ms left after 700 ms.
  EXPECT_THAT(waits.timeouts, ElementsAre(absl::Seconds(1), absl::Milliseconds(300)));
}

}  // namespace
}  // namespace aloe::server
