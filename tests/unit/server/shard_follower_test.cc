// A shard process following its coordinator, with scripted streams instead of sockets and a
// recorded wait instead of a clock: what each stream's orders do to the state, what the next
// request says after a reconnect, how long each wait between streams is, and when Run ends.
#include "server/core/shard_follower.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::ShardOrder Order(v1::ShardOrder::Kind kind, uint64_t version) {
  v1::ShardOrder order;
  order.set_kind(kind);
  order.set_version(version);
  return order;
}
v1::ShardOrder Commit(uint64_t version) { return Order(v1::ShardOrder::COMMIT, version); }
v1::ShardOrder Restore(uint64_t version) { return Order(v1::ShardOrder::RESTORE, version); }
v1::ShardOrder Finish(uint64_t version) { return Order(v1::ShardOrder::FINISH, version); }

// What one stream delivers, then how it ends; `on_read` runs before each Read (for a Stop from
// "another thread").
struct Script {
  std::vector<v1::ShardOrder> orders;
  absl::Status end = absl::UnavailableError("connection refused");
  std::function<void()> on_read;
};

// `cancelled` outlives the stream (the follower drops the stream when it ends).
class ScriptedStream final : public OrderStream {
 public:
  ScriptedStream(Script script, std::shared_ptr<bool> cancelled)
      : script_(std::move(script)), cancelled_(std::move(cancelled)) {}
  bool Read(v1::ShardOrder* order) override {
    if (script_.on_read) script_.on_read();
    if (*cancelled_ || next_ == script_.orders.size()) return false;
    *order = script_.orders[next_++];
    return true;
  }
  void Cancel() override { *cancelled_ = true; }
  absl::Status Finish() override {
    return *cancelled_ ? absl::CancelledError("cancelled") : script_.end;
  }

 private:
  Script script_;
  size_t next_ = 0;
  std::shared_ptr<bool> cancelled_;
};

// Hands out the scripted streams in turn; past the last, streams the coordinator refuses for
// good (so a runaway Run ends).
class ScriptedTransport final : public FollowTransport {
 public:
  std::unique_ptr<OrderStream> Open(const v1::FollowRequest& request) override {
    requests.push_back(request);
    Script script;
    if (scripts.empty()) {
      script.end = absl::FailedPreconditionError("no more scripted streams");
    } else {
      script = std::move(scripts.front());
      scripts.pop_front();
    }
    cancelled.push_back(std::make_shared<bool>(false));
    return std::make_unique<ScriptedStream>(std::move(script), cancelled.back());
  }

  std::deque<Script> scripts;
  std::vector<v1::FollowRequest> requests;
  std::vector<std::shared_ptr<bool>> cancelled;  // per stream opened: whether it was cancelled
};

// A shard process's state as far as following goes: like ShardState, it takes COMMIT only of
// the next version and changes nothing when it refuses one.
class FakeState final : public FollowedState {
 public:
  void Describe(v1::FollowRequest* request) override {
    request->set_version(version_);
    request->set_fresh(fresh);
    for (uint64_t v : checkpoints) request->add_checkpoint_versions(v);
  }
  uint64_t version() override { return version_; }
  absl::Status Apply(const v1::ShardOrder& order) override {
    if (order.kind() == v1::ShardOrder::RESTORE) {
      version_ = order.version();
      fresh = false;
    } else if (order.kind() == v1::ShardOrder::COMMIT) {
      if (order.version() != version_ + 1) {
        return absl::FailedPreconditionError("commit out of order");
      }
      version_ = order.version();
    }
    applied.push_back(order.kind() == v1::ShardOrder::RESTORE ? -int64_t(order.version())
                                                              : int64_t(order.version()));
    return absl::OkStatus();
  }
  void MarkFresh() override { fresh = true; }

  bool fresh = true;
  std::vector<uint64_t> checkpoints;
  std::vector<int64_t> applied;  // COMMIT v as v, RESTORE v as -v

 private:
  uint64_t version_ = 0;
};

class RecordedWait final : public ReconnectWait {
 public:
  void Wait(absl::Duration delay) override {
    delays.push_back(delay);
    if (on_wait) on_wait();
  }
  void Interrupt() override { ++interrupts; }

  std::vector<absl::Duration> delays;
  std::function<void()> on_wait;
  int interrupts = 0;
};

class ShardFollowerTest : public ::testing::Test {
 protected:
  ShardFollower::Options Options() {
    ShardFollower::Options options;
    options.shard_index = 3;
    options.address = "10.0.0.7:7001";
    options.push_address = "10.0.0.7:7101";
    options.fingerprint = "fp";
    return options;
  }

  ScriptedTransport transport;
  FakeState state;
  RecordedWait wait;
  ShardFollower follower{Options(), transport, state, wait};
};

absl::Duration Ms(int64_t ms) { return absl::Milliseconds(ms); }

TEST_F(ShardFollowerTest, FollowsAgainFromItsVersionAfterTheCoordinatorDropsTheStream) {
  transport.scripts.push_back({{Restore(0), Commit(1), Commit(2)}, absl::UnavailableError("gone")});
  transport.scripts.push_back({{Commit(3), Finish(3)}});
  state.checkpoints = {2};

  EXPECT_THAT(follower.Run(), IsOk());

  EXPECT_THAT(state.applied, ElementsAre(0, 1, 2, 3));
  ASSERT_EQ(transport.requests.size(), 2u);
  const v1::FollowRequest& first = transport.requests[0];
  EXPECT_EQ(first.shard_index(), 3u);
  EXPECT_EQ(first.address(), "10.0.0.7:7001");
  EXPECT_EQ(first.push_address(), "10.0.0.7:7101");
  EXPECT_EQ(first.fingerprint(), "fp");
  EXPECT_TRUE(first.fresh());
  EXPECT_EQ(first.version(), 0u);
  // After the drop: the version reached, not fresh (only the connection was lost).
  const v1::FollowRequest& again = transport.requests[1];
  EXPECT_FALSE(again.fresh());
  EXPECT_EQ(again.version(), 2u);
  EXPECT_THAT(again.checkpoint_versions(), ElementsAre(2u));
  // The dropped stream had reached the coordinator: the first wait, not a longer one.
  EXPECT_THAT(wait.delays, ElementsAre(Ms(200)));
  EXPECT_EQ(follower.streams(), 2u);
  // FINISH ends the stream from this side.
  EXPECT_TRUE(*transport.cancelled[1]);
}

TEST_F(ShardFollowerTest, BacksOffWhileTheCoordinatorIsAwayAndStartsOverOnceReached) {
  for (int i = 0; i < 5; ++i) transport.scripts.push_back({});  // refused connections
  transport.scripts.push_back({{Restore(0), Commit(1)}, absl::UnavailableError("gone")});
  for (int i = 0; i < 2; ++i) transport.scripts.push_back({});
  // The coordinator's own answer (a reassembly) counts as reached too.
  transport.scripts.push_back({{}, absl::AbortedError("the shards are reassembling")});
  transport.scripts.push_back({});
  transport.scripts.push_back({{Finish(1)}});

  EXPECT_THAT(follower.Run(), IsOk());

  EXPECT_THAT(wait.delays, ElementsAre(Ms(200), Ms(400), Ms(800), Ms(1600), Ms(2000),  // away
                                       Ms(200),                                        // reached
                                       Ms(200), Ms(400),  // away again: from the start
                                       Ms(200),           // ABORTED
                                       Ms(200)));
  EXPECT_EQ(follower.streams(), 11u);
  EXPECT_THAT(state.applied, ElementsAre(0, 1));
}

TEST(ReconnectBackoffTest, DoublesUpToTheCapAndStartsOverWhenReached) {
  ReconnectBackoff backoff(Ms(100), Ms(700));
  EXPECT_EQ(backoff.After(false), Ms(100));
  EXPECT_EQ(backoff.After(false), Ms(200));
  EXPECT_EQ(backoff.After(false), Ms(400));
  EXPECT_EQ(backoff.After(false), Ms(700));
  EXPECT_EQ(backoff.After(false), Ms(700));
  EXPECT_EQ(backoff.unreached(), 5u);
  EXPECT_EQ(backoff.After(true), Ms(100));
  EXPECT_EQ(backoff.unreached(), 0u);
  EXPECT_EQ(backoff.After(false), Ms(100));
  // Many failures do not overflow the doubling.
  for (int i = 0; i < 200; ++i) backoff.After(false);
  EXPECT_EQ(backoff.After(false), Ms(700));
}

TEST_F(ShardFollowerTest, AReassemblyRestoresTheCommonVersionBeforeTheNewLog) {
  // Another shard process restarted: the coordinator ends this stream (a new assembly) and the
  // next starts with RESTORE of the version every process can be at.
  state.checkpoints = {2};
  transport.scripts.push_back({{Restore(0), Commit(1), Commit(2), Commit(3)},
                               absl::AbortedError("the shards are reassembling; follow again")});
  transport.scripts.push_back({{Restore(2), Commit(3), Commit(4), Finish(4)}});

  EXPECT_THAT(follower.Run(), IsOk());

  EXPECT_THAT(state.applied, ElementsAre(0, 1, 2, 3, -2, 3, 4));
  ASSERT_EQ(transport.requests.size(), 2u);
  EXPECT_FALSE(transport.requests[1].fresh());
  EXPECT_EQ(transport.requests[1].version(), 3u);
  EXPECT_THAT(wait.delays, ElementsAre(Ms(200)));
}

TEST_F(ShardFollowerTest, AStaleCommitIsRefusedWithTheStateUnchangedAndAsksForAReassembly) {
  transport.scripts.push_back({{Restore(0), Commit(1), Commit(2), Commit(2), Commit(3)}});
  transport.scripts.push_back({{Restore(1), Commit(2), Finish(2)}});

  EXPECT_THAT(follower.Run(), IsOk());

  // The duplicate COMMIT 2 changed nothing and nothing after it was applied on that stream.
  EXPECT_THAT(state.applied, ElementsAre(0, 1, 2, -1, 2));
  EXPECT_TRUE(*transport.cancelled[0]);
  ASSERT_EQ(transport.requests.size(), 2u);
  EXPECT_TRUE(transport.requests[1].fresh());  // the processes must reassemble
  EXPECT_EQ(transport.requests[1].version(), 2u);
  EXPECT_THAT(wait.delays, ElementsAre(Ms(200)));
}

TEST_F(ShardFollowerTest, AFinishOfAnotherVersionIsRefusedAndTheStreamGoesOn) {
  transport.scripts.push_back({{Restore(0), Commit(1), Finish(5), Commit(2), Finish(2)}});

  EXPECT_THAT(follower.Run(), IsOk());

  EXPECT_THAT(state.applied, ElementsAre(0, 1, 2));
  EXPECT_EQ(state.version(), 2u);
  EXPECT_EQ(follower.streams(), 1u);
  EXPECT_TRUE(wait.delays.empty());
}

TEST_F(ShardFollowerTest, ARefusalForGoodEndsRunWithoutFollowingAgain) {
  transport.scripts.push_back({{}, absl::FailedPreconditionError("another model")});

  const absl::Status status = follower.Run();

  EXPECT_THAT(status, StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("the coordinator refuses shard 3: another model")));
  EXPECT_EQ(follower.streams(), 1u);
  EXPECT_TRUE(wait.delays.empty());
}

TEST_F(ShardFollowerTest, AWrongTokenIsARefusalForGoodToo) {
  transport.scripts.push_back({{}, absl::UnauthenticatedError("unknown token")});

  EXPECT_THAT(follower.Run(), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("token")));
  EXPECT_EQ(follower.streams(), 1u);
}

TEST_F(ShardFollowerTest, StopWhileReadingCancelsTheStreamAndOpensNoOther) {
  Script script{{Restore(0), Commit(1), Commit(2)}};
  int reads = 0;
  script.on_read = [&] {
    if (++reads == 3) follower.Stop();
  };
  transport.scripts.push_back(std::move(script));

  EXPECT_THAT(follower.Run(), IsOk());

  // The order read before Stop was applied; none after it.
  EXPECT_THAT(state.applied, ElementsAre(0, 1));
  EXPECT_EQ(follower.streams(), 1u);
  EXPECT_TRUE(*transport.cancelled[0]);
  EXPECT_TRUE(wait.delays.empty());
  EXPECT_EQ(wait.interrupts, 1);
}

TEST_F(ShardFollowerTest, StopWhileWaitingOpensNoOtherStream) {
  transport.scripts.push_back({});
  transport.scripts.push_back({});
  wait.on_wait = [&] { follower.Stop(); };

  EXPECT_THAT(follower.Run(), IsOk());

  EXPECT_EQ(follower.streams(), 1u);
  EXPECT_THAT(wait.delays, ElementsAre(Ms(200)));
  EXPECT_EQ(transport.scripts.size(), 1u);  // the second stream was never opened
}

TEST_F(ShardFollowerTest, StopBeforeRunOpensNothing) {
  follower.Stop();
  EXPECT_THAT(follower.Run(), IsOk());
  EXPECT_EQ(follower.streams(), 0u);
  EXPECT_TRUE(transport.requests.empty());
}

}  // namespace
}  // namespace aloe::server
