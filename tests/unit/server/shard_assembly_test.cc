// The coordinator's assembly of its shard processes as state transitions: which streams may go
// on, when the shards (re)assemble, where the log may be trimmed and who was told to finish. No
// sockets or threads: each call is what ShardControlService does for one Follow step.
#include "server/core/shard_assembly.h"

#include <gtest/gtest.h>

#include <optional>
#include <vector>

namespace aloe::server {
namespace {

using Stream = ShardAssembly::Stream;

v1::FollowRequest Request(uint64_t version, bool fresh, std::vector<uint64_t> checkpoints = {}) {
  v1::FollowRequest request;
  request.set_version(version);
  request.set_fresh(fresh);
  request.set_address("127.0.0.1:7001");
  for (uint64_t v : checkpoints) request.add_checkpoint_versions(v);
  return request;
}

// Both shards of a fresh coordinator join; the first assembly completes at `version`.
void AssembleBoth(ShardAssembly& a, uint64_t* c0, uint64_t* c1, uint64_t version = 0) {
  *c0 = a.Connect(0, Request(version, true));
  ASSERT_FALSE(a.MayFollowOn(0));
  EXPECT_FALSE(a.Join(0));
  *c1 = a.Connect(1, Request(version, true));
  EXPECT_FALSE(a.Join(1));
  ASSERT_TRUE(a.Starts().has_value());
  a.Complete(version);
}

// Two shard processes assembled at version 0, following on connections c0 and c1.
class AssembledPairTest : public ::testing::Test {
 protected:
  void SetUp() override { AssembleBoth(a, &c0, &c1); }

  ShardAssembly a{2};
  uint64_t c0 = 0;
  uint64_t c1 = 0;
};

TEST(ShardAssemblyStateTest, TheFirstAssemblyWaitsForEveryShardThenBothFollow) {
  ShardAssembly a(2);
  EXPECT_FALSE(a.ready());
  const uint64_t c0 = a.Connect(0, Request(0, true, {}));
  EXPECT_FALSE(a.MayFollowOn(0));
  EXPECT_FALSE(a.Join(0));  // nothing was assembled: no new assembly begins
  EXPECT_EQ(a.StreamState(0, c0), Stream::kWaiting);
  EXPECT_FALSE(a.Starts().has_value());  // shard 1 has not joined
  const uint64_t c1 = a.Connect(1, Request(4, false, {4, 2}));
  a.Join(1);
  const std::optional<std::vector<ShardStart>> starts = a.Starts();
  ASSERT_TRUE(starts.has_value());
  ASSERT_EQ(starts->size(), 2u);
  EXPECT_EQ((*starts)[1].version, 4u);
  EXPECT_EQ((*starts)[1].checkpoints, (std::vector<uint64_t>{4, 2}));
  // The first assembly at the coordinator's own version needs no restore; any other does.
  EXPECT_FALSE(a.NeedsRestore(0, 0));
  EXPECT_TRUE(a.NeedsRestore(2, 4));
  a.Complete(0);
  EXPECT_TRUE(a.ready());
  EXPECT_EQ(a.start_version(), 0u);
  EXPECT_EQ(a.StreamState(0, c0), Stream::kFollowing);
  EXPECT_EQ(a.StreamState(1, c1), Stream::kFollowing);
  EXPECT_TRUE(a.NeedsRestore(0, 0));  // after the first assembly, always
}

TEST_F(AssembledPairTest, AShardThatOnlyLostItsConnectionFollowsOnAndSupersedesItsOldStream) {
  const uint64_t epoch = a.epoch_of(0);
  const uint64_t again = a.Connect(0, Request(3, /*fresh=*/false));
  ASSERT_TRUE(a.MayFollowOn(0));
  a.FollowOn(0, 7);
  EXPECT_TRUE(a.ready());  // no reassembly: shard 1 goes on
  EXPECT_TRUE(a.Current(1, c1, epoch));
  EXPECT_TRUE(a.Current(0, again, epoch));
  EXPECT_FALSE(a.Current(0, c0, epoch));  // the old stream of shard 0 ends
  EXPECT_EQ(a.StreamState(0, c0), Stream::kEnded);
}

TEST_F(AssembledPairTest, ARestartedShardMakesEveryProcessReassembleWithARestore) {
  const uint64_t old_epoch = a.epoch_of(1);
  const uint64_t restarted = a.Connect(0, Request(5, /*fresh=*/true, {5, 3}));
  EXPECT_FALSE(a.MayFollowOn(0));
  EXPECT_TRUE(a.Join(0));  // a new assembly began
  EXPECT_FALSE(a.ready());
  EXPECT_GT(a.current_epoch(), old_epoch);
  EXPECT_FALSE(a.Current(1, c1, old_epoch));  // shard 1's stream ends: it must follow again
  EXPECT_EQ(a.StreamState(1, c1), Stream::kEnded);
  EXPECT_EQ(a.StreamState(0, restarted), Stream::kWaiting);
  EXPECT_FALSE(a.Starts().has_value());
  // Shard 1 comes back (not fresh): the shards are not assembled, so it joins rather than
  // following on, and no further assembly begins.
  const uint64_t back = a.Connect(1, Request(6, false, {6, 3}));
  EXPECT_FALSE(a.MayFollowOn(1));
  EXPECT_FALSE(a.Join(1));
  const std::optional<std::vector<ShardStart>> starts = a.Starts();
  ASSERT_TRUE(starts.has_value());
  EXPECT_EQ(ChooseCommonVersion({6, 3}, *starts), 3u);
  EXPECT_TRUE(a.NeedsRestore(3, 6));
  a.Complete(3);
  EXPECT_EQ(a.start_version(), 3u);
  EXPECT_EQ(a.StreamState(0, restarted), Stream::kFollowing);
  EXPECT_EQ(a.StreamState(1, back), Stream::kFollowing);
}

TEST(ShardAssemblyStateTest, AFailedRestoreStartsOverAndEndsTheWaitingStreams) {
  ShardAssembly a(1);
  const uint64_t c = a.Connect(0, Request(0, true));
  a.Join(0);
  ASSERT_TRUE(a.Starts().has_value());
  a.Begin();  // the restore failed
  EXPECT_EQ(a.StreamState(0, c), Stream::kEnded);
  EXPECT_FALSE(a.Starts().has_value());
  const uint64_t again = a.Connect(0, Request(0, true));
  a.Join(0);
  ASSERT_TRUE(a.Starts().has_value());
  a.Complete(0);
  EXPECT_EQ(a.StreamState(0, again), Stream::kFollowing);
}

TEST_F(AssembledPairTest, TheLogIsTrimmedASlackBehindTheSlowestShard) {
  const uint64_t epoch = a.epoch_of(0);
  const uint64_t k = ShardAssembly::kLogSlack;
  EXPECT_EQ(a.Sent(0, c0, epoch, 5 * k), std::nullopt);      // shard 1 is still at 0
  EXPECT_EQ(a.Sent(1, c1, epoch, 2 * k - 1), std::nullopt);  // the slowest is not 2 slacks in
  EXPECT_EQ(a.Sent(1, c1, epoch, 3 * k), std::optional<uint64_t>(2 * k));
  EXPECT_EQ(a.Sent(1, c1, epoch, 7 * k), std::optional<uint64_t>(4 * k));  // shard 0 at 5k
  // A stream that is not current moves nothing.
  EXPECT_EQ(a.Sent(0, c0 + 1, epoch, 100 * k), std::nullopt);
  EXPECT_EQ(a.Sent(0, c0, epoch, 6 * k), std::optional<uint64_t>(5 * k));
  // While a shard waits in a new assembly nothing is trimmed.
  a.Connect(0, Request(0, true));
  a.Join(0);
  EXPECT_EQ(a.Sent(1, c1, epoch, 9 * k), std::nullopt);
}

TEST(ShardAssemblyStateTest, FinishCountsTheShardsTold) {
  ShardAssembly a(3);
  EXPECT_EQ(a.finish_version(), std::nullopt);
  a.Finish(12);
  EXPECT_EQ(a.finish_version(), std::optional<uint64_t>(12));
  a.FinishSent(2);
  a.FinishSent(2);
  a.FinishSent(0);
  EXPECT_EQ(a.finished_shards(), 2u);
}

TEST(ShardAssemblyStateTest, OnlyARefusalForGoodStopsAShardFollowing) {
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kUnauthenticated, absl::StatusCode::kPermissionDenied}) {
    EXPECT_TRUE(RefusedForGood(code)) << absl::StatusCodeToString(code);
  }
  for (absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kAborted, absl::StatusCode::kUnavailable,
        absl::StatusCode::kCancelled, absl::StatusCode::kDeadlineExceeded}) {
    EXPECT_FALSE(RefusedForGood(code)) << absl::StatusCodeToString(code);
  }
}

}  // namespace
}  // namespace aloe::server
