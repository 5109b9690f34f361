#include "server/core/shard_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/status_matchers.h"
#include "tests/testing/shard_orders.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::_;
using ::testing::ElementsAre;
using ::testing::FloatEq;
using ::testing::FloatNear;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pointwise;

constexpr char kFingerprint[] = "outer=OUTER_NESTEROV/N=1;embed:3;blocks.0:2;blocks.1:4;head:2";

// Four layers over two shard processes, interleaved so that local and global ids differ:
//   0 "embed" (3) -> shard 0, 1 "blocks.0" (2) -> shard 1, 2 "blocks.1" (4) -> shard 0,
//   3 "head" (2) -> shard 1.
v1::ModelSpec FourLayerSpec() {
  v1::ModelSpec spec;
  spec.set_num_shards(2);
  const char* names[] = {"embed", "blocks.0", "blocks.1", "head"};
  const uint64_t sizes[] = {3, 2, 4, 2};
  for (uint32_t i = 0; i < 4; ++i) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(i);
    layer->set_name(names[i]);
    layer->set_num_elements(sizes[i]);
    layer->set_shard(i % 2);
  }
  return spec;
}

std::vector<std::vector<float>> Initial() { return {{1, 2, 3}, {10, 20}, {4, 5, 6, 7}, {30, 40}}; }

v1::OuterOptimizerConfig Sgd(float lr) {
  v1::OuterOptimizerConfig c;
  c.set_type(v1::OUTER_SGD);
  c.set_lr(lr);
  return c;
}

v1::OuterOptimizerConfig Nesterov() {
  v1::OuterOptimizerConfig c;
  c.set_type(v1::OUTER_NESTEROV);
  c.set_lr(0.5f);
  c.set_momentum(0.9f);
  return c;
}

std::unique_ptr<ShardState> MakeShard(Executor& executor, uint32_t index,
                                      const v1::OuterOptimizerConfig& optimizer = Sgd(0.5f),
                                      uint32_t max_staged = 4) {
  auto shard = ShardState::Create(FourLayerSpec(), index, Initial(), optimizer,
                                  /*apply_groups=*/2, max_staged, executor);
  EXPECT_THAT(shard, IsOk());
  return *std::move(shard);
}

// A whole update's part for shard 0 (layers 0 and 2 filled, 1 and 3 empty).
PendingUpdate Part0(uint64_t worker, uint64_t update, std::vector<float> embed,
                    std::vector<float> block1) {
  PendingUpdate u;
  u.worker_id = worker;
  u.update_id = update;
  u.task_id = 100 + update;
  u.steps_done = 50;
  u.tokens_learned = 6400;
  u.layers = {std::move(embed), {}, std::move(block1), {}};
  return u;
}

// The same for shard 1 (layers 1 and 3).
PendingUpdate Part1(uint64_t worker, uint64_t update, std::vector<float> block0,
                    std::vector<float> head) {
  PendingUpdate u = Part0(worker, update, {}, {});
  u.layers = {{}, std::move(block0), {}, std::move(head)};
  return u;
}

// Slice `slice` of 2 of a shard 0 part: full-size buffers, the other slice's elements zero
// (SliceRange: embed 3 -> [0,2) [2,3), blocks.1 4 -> [0,2) [2,4)).
PendingUpdate Slice0(uint64_t worker, uint64_t update, uint32_t slice, std::vector<float> embed,
                     std::vector<float> block1) {
  PendingUpdate u = Part0(worker, update, std::move(embed), std::move(block1));
  u.slice = slice;
  u.slices = 2;
  return u;
}

using ::aloe::testing::CommitOrder;

std::vector<float> Layer(const ShardState& shard, uint32_t layer) {
  absl::StatusOr<ModelSnapshot> s = shard.SnapshotAt(shard.version());
  EXPECT_THAT(s, IsOk());
  if (!s.ok() || s->layers[layer] == nullptr) return {};
  return *s->layers[layer];
}

// --- Create

TEST(ShardStateCreateTest, OwnsItsLayersAndServesThemByGlobalId) {
  InlineExecutor executor;
  auto shard0 = MakeShard(executor, 0);
  auto shard1 = MakeShard(executor, 1);
  EXPECT_THAT(shard0->owned_layers(), ElementsAre(0u, 2u));
  EXPECT_THAT(shard1->owned_layers(), ElementsAre(1u, 3u));
  EXPECT_EQ(shard1->shard_index(), 1u);
  EXPECT_EQ(shard0->version(), 0u);
  absl::StatusOr<ModelSnapshot> s = shard1->SnapshotAt(0);
  ASSERT_THAT(s, IsOk());
  ASSERT_EQ(s->layers.size(), 4u);
  EXPECT_EQ(s->layers[0], nullptr);
  EXPECT_EQ(*s->layers[1], (std::vector<float>{10, 20}));
  EXPECT_EQ(s->layers[2], nullptr);
  EXPECT_EQ(*s->layers[3], (std::vector<float>{30, 40}));
}

TEST(ShardStateCreateTest, ForeignInitialValuesAreIgnored) {
  InlineExecutor executor;
  std::vector<std::vector<float>> initial = Initial();
  initial[1].clear();
  initial[3] = {1, 2, 3, 4, 5};  // wrong size, but not shard 0's business
  auto shard = ShardState::Create(FourLayerSpec(), 0, initial, Sgd(1), 1, 4, executor);
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ(Layer(**shard, 2), (std::vector<float>{4, 5, 6, 7}));
}

TEST(ShardStateCreateTest, RejectsBadArguments) {
  InlineExecutor executor;
  EXPECT_THAT(ShardState::Create(FourLayerSpec(), 2, Initial(), Sgd(1), 1, 4, executor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard index 2")));

  std::vector<std::vector<float>> short_block = Initial();
  short_block[2] = {4, 5, 6};
  EXPECT_THAT(ShardState::Create(FourLayerSpec(), 0, short_block, Sgd(1), 1, 4, executor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2 (blocks.1)")));

  EXPECT_THAT(ShardState::Create(FourLayerSpec(), 0, Initial(), Sgd(1), 1, 0, executor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_staged")));

  EXPECT_THAT(ShardState::Create(FourLayerSpec(), 0, Initial(), Sgd(0), 1, 4, executor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outer_optimizer.lr")));
}

TEST(ShardStateCreateTest, RejectsAShardThatOwnsNoLayer) {
  InlineExecutor executor;
  v1::ModelSpec spec = FourLayerSpec();
  spec.set_num_shards(3);  // layers still only on shards 0 and 1
  EXPECT_THAT(
      ShardState::Create(spec, 2, Initial(), Sgd(1), 1, 4, executor),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard 2 of 3 owns no layer")));
  EXPECT_THAT(ShardState::Create(spec, 1, Initial(), Sgd(1), 1, 4, executor), IsOk());
}

// --- Staging

TEST(ShardStateStageTest, WholeUpdateIsCompleteAtOnce) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  absl::StatusOr<StageResult> r = shard->Stage(Part0(1, 1, {1, 1, 1}, {2, 2, 2, 2}));
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(r->slices_received, 1u);
  EXPECT_TRUE(shard->IsStaged(1, 1));
  EXPECT_FALSE(shard->IsStaged(1, 2));
  EXPECT_EQ(shard->staged_count(), 1u);
  EXPECT_EQ(shard->staged_bytes(), (3u + 4u) * 4u);
}

TEST(ShardStateStageTest, RejectsDataForAForeignLayer) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  PendingUpdate u = Part0(1, 1, {1, 1, 1}, {2, 2, 2, 2});
  u.layers[1] = {5, 5};  // blocks.0 belongs to shard 1
  EXPECT_THAT(shard->Stage(std::move(u)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1 (blocks.0)")));
  EXPECT_EQ(shard->staged_count(), 0u);
  EXPECT_EQ(shard->staged_bytes(), 0u);
}

TEST(ShardStateStageTest, RejectsAnOwnedLayerOfTheWrongSize) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {2, 2, 2, 2})), IsOk());
  // Neither a new update nor a retry of a staged one gets in with a bad shape.
  EXPECT_THAT(shard->Stage(Part0(2, 1, {1, 1, 1}, {2, 2, 2})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2 (blocks.1)")));
  EXPECT_THAT(shard->Stage(Part0(1, 1, {}, {2, 2, 2, 2})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0 (embed)")));
  EXPECT_EQ(shard->staged_count(), 1u);
  EXPECT_TRUE(shard->IsStaged(1, 1));
  EXPECT_EQ(shard->staged_bytes(), 28u);
}

TEST(ShardStateStageTest, SlicesMergeAndARetriedSliceReplacesItsCopy) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1));
  absl::StatusOr<StageResult> r = shard->Stage(Slice0(1, 1, 0, {9, 9, 0}, {9, 9, 0, 0}));
  ASSERT_THAT(r, IsOk());
  EXPECT_FALSE(r->complete);
  EXPECT_EQ(r->slices_received, 1u);
  EXPECT_FALSE(shard->IsStaged(1, 1));
  // The retry of slice 0 carries other values: the newer copy wins, still one slice received.
  r = shard->Stage(Slice0(1, 1, 0, {1, 2, 0}, {3, 4, 0, 0}));
  ASSERT_THAT(r, IsOk());
  EXPECT_FALSE(r->complete);
  EXPECT_EQ(r->slices_received, 1u);
  // Slice 1's zeros outside its range must not overwrite slice 0's elements.
  r = shard->Stage(Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7}));
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(r->slices_received, 2u);
  EXPECT_TRUE(shard->IsStaged(1, 1));
  // Once complete, a retried slice with the same header keeps it complete.
  r = shard->Stage(Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7}));
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(r->slices_received, 2u);
  EXPECT_EQ(shard->staged_count(), 1u);

  // lr 1, weight 1: theta = theta0 - merged = {1,2,3} - {1,2,5}, {4,5,6,7} - {3,4,6,7}.
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{0, 0, -2}));
  EXPECT_EQ(Layer(*shard, 2), (std::vector<float>{1, 1, 0, 0}));
}

TEST(ShardStateStageTest, RejectsASliceThatDisagreesWithItsUpdate) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Slice0(1, 1, 0, {1, 2, 0}, {3, 4, 0, 0})), IsOk());

  PendingUpdate steps = Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7});
  steps.steps_done = 49;
  EXPECT_THAT(shard->Stage(std::move(steps)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("update 1 of worker 1")));
  PendingUpdate tokens = Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7});
  tokens.tokens_learned = 1;
  EXPECT_THAT(shard->Stage(std::move(tokens)), StatusIs(absl::StatusCode::kInvalidArgument, _));
  PendingUpdate task = Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7});
  task.task_id = 7;
  EXPECT_THAT(shard->Stage(std::move(task)), StatusIs(absl::StatusCode::kInvalidArgument, _));
  PendingUpdate slices = Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7});
  slices.slices = 3;
  EXPECT_THAT(shard->Stage(std::move(slices)), StatusIs(absl::StatusCode::kInvalidArgument, _));
  // A whole copy of a sliced update disagrees on `slices` as well.
  EXPECT_THAT(shard->Stage(Part0(1, 1, {1, 2, 5}, {3, 4, 6, 7})),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
  PendingUpdate out_of_range = Slice0(1, 1, 2, {0, 0, 5}, {0, 0, 6, 7});
  EXPECT_THAT(shard->Stage(std::move(out_of_range)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slice 2 of 2")));

  // Nothing changed: still one slice of one update; the matching slice completes it.
  EXPECT_EQ(shard->staged_count(), 1u);
  EXPECT_FALSE(shard->IsStaged(1, 1));
  absl::StatusOr<StageResult> r = shard->Stage(Slice0(1, 1, 1, {0, 0, 5}, {0, 0, 6, 7}));
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->complete);
}

TEST(ShardStateStageTest, RetriedWholeUpdateReplacesTheStagedCopy) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1));
  ASSERT_THAT(shard->Stage(Part0(1, 1, {9, 9, 9}, {9, 9, 9, 9})), IsOk());
  absl::StatusOr<StageResult> r = shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1}));
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(r->slices_received, 1u);
  EXPECT_EQ(shard->staged_count(), 1u);
  EXPECT_EQ(shard->staged_bytes(), 28u);
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{0, 1, 2}));
}

TEST(ShardStateStageTest, UpdatesOfOneWorkerAreStagedSideBySide) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1));
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 0, 0}, {0, 0, 0, 0})), IsOk());
  ASSERT_THAT(shard->Stage(Part0(1, 2, {0, 1, 0}, {0, 0, 0, 0})), IsOk());
  EXPECT_EQ(shard->staged_count(), 2u);
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  EXPECT_FALSE(shard->IsStaged(1, 1));
  EXPECT_TRUE(shard->IsStaged(1, 2));
  ASSERT_THAT(shard->Apply(CommitOrder(2, {{1, 2, 1.0f}})), IsOk());
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{0, 1, 3}));
  EXPECT_EQ(shard->staged_count(), 0u);
}

// --- Bounded staging

TEST(ShardStateBoundedStagingTest, NewUpdatesWaitForRoomRetriesDoNot) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1), /*max_staged=*/2);
  EXPECT_TRUE(shard->HasRoom(1, 1));
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  // A partly staged update takes a slot too.
  ASSERT_THAT(shard->Stage(Slice0(2, 1, 0, {1, 1, 0}, {1, 1, 0, 0})), IsOk());
  EXPECT_FALSE(shard->HasRoom(3, 1));
  EXPECT_FALSE(shard->HasRoom(1, 2));
  EXPECT_TRUE(shard->HasRoom(1, 1));
  EXPECT_TRUE(shard->HasRoom(2, 1));
  EXPECT_THAT(shard->Stage(Part0(3, 1, {1, 1, 1}, {1, 1, 1, 1})),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("staging full: 2 of 2 updates staged")));
  EXPECT_EQ(shard->staged_count(), 2u);
  EXPECT_EQ(shard->staged_bytes(), 2u * 28u);
  // Retries and the missing slice of staged updates still get in.
  EXPECT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  EXPECT_THAT(shard->Stage(Slice0(2, 1, 1, {0, 0, 1}, {0, 0, 1, 1})), IsOk());
  EXPECT_EQ(shard->staged_count(), 2u);

  // A discard frees a slot...
  shard->Discard(2, 1);
  EXPECT_TRUE(shard->HasRoom(3, 1));
  ASSERT_THAT(shard->Stage(Part0(3, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  EXPECT_FALSE(shard->HasRoom(4, 1));
  // ... and so does a commit.
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 0.5f}})), IsOk());
  EXPECT_TRUE(shard->HasRoom(4, 1));
  EXPECT_THAT(shard->Stage(Part0(4, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
}

TEST(ShardStateBoundedStagingTest, DiscardOfAnAbsentUpdateIsANoOp) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  shard->Discard(1, 2);
  shard->Discard(2, 1);
  EXPECT_EQ(shard->staged_count(), 1u);
  shard->Discard(1, 1);
  EXPECT_EQ(shard->staged_count(), 0u);
  EXPECT_EQ(shard->staged_bytes(), 0u);
}

// --- Orders

TEST(ShardStateCommitTest, AppliesTheWeightedSumToTheOwnedLayersOfEachShard) {
  ThreadPoolExecutor executor(2);        // each shard's two layers stepped in parallel groups
  auto shard0 = MakeShard(executor, 0);  // SGD lr 0.5
  auto shard1 = MakeShard(executor, 1);
  ASSERT_THAT(shard0->Stage(Part0(1, 1, {1, 1, 1}, {2, 2, 2, 2})), IsOk());
  ASSERT_THAT(shard0->Stage(Part0(2, 1, {3, 0, -1}, {0, 4, 0, -4})), IsOk());
  ASSERT_THAT(shard1->Stage(Part1(1, 1, {4, -2}, {0, 8})), IsOk());
  ASSERT_THAT(shard1->Stage(Part1(2, 1, {0, 2}, {4, 0})), IsOk());
  const v1::ShardOrder order = CommitOrder(1, {{1, 1, 0.25f}, {2, 1, 0.75f}});
  ASSERT_THAT(shard0->Apply(order), IsOk());
  ASSERT_THAT(shard1->Apply(order), IsOk());

  // g = 0.25 u1 + 0.75 u2; theta -= 0.5 g:
  //   embed    g = {2.5, 0.25, -0.5}      {1,2,3}    -> {-0.25, 1.875, 3.25}
  //   blocks.1 g = {0.5, 3.5, 0.5, -2.5}  {4,5,6,7}  -> {3.75, 3.25, 5.75, 8.25}
  //   blocks.0 g = {1, 1}                 {10,20}    -> {9.5, 19.5}
  //   head     g = {3, 2}                 {30,40}    -> {28.5, 39}
  EXPECT_THAT(Layer(*shard0, 0), Pointwise(FloatEq(), {-0.25f, 1.875f, 3.25f}));
  EXPECT_THAT(Layer(*shard0, 2), Pointwise(FloatEq(), {3.75f, 3.25f, 5.75f, 8.25f}));
  EXPECT_THAT(Layer(*shard1, 1), Pointwise(FloatEq(), {9.5f, 19.5f}));
  EXPECT_THAT(Layer(*shard1, 3), Pointwise(FloatEq(), {28.5f, 39.0f}));
  EXPECT_THAT(Layer(*shard0, 1), IsEmpty());  // foreign: no buffer
  for (ShardState* s : {shard0.get(), shard1.get()}) {
    EXPECT_EQ(s->version(), 1u);
    EXPECT_EQ(s->staged_count(), 0u);
    EXPECT_FALSE(s->IsStaged(1, 1));
  }
}

TEST(ShardStateCommitTest, WeightsAreUsedAsGivenNotRenormalised) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1));
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 2, 3}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 0.5f}})), IsOk());
  // theta = {1,2,3} - 0.5 {1,2,3}, not {1,2,3} - {1,2,3}.
  EXPECT_THAT(Layer(*shard, 0), Pointwise(FloatEq(), {0.5f, 1.0f, 1.5f}));
  EXPECT_THAT(Layer(*shard, 2), Pointwise(FloatEq(), {3.5f, 4.5f, 5.5f, 6.5f}));
}

TEST(ShardStateCommitTest, MissingOrIncompleteUpdateChangesNothing) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Stage(Slice0(2, 5, 0, {1, 1, 0}, {1, 1, 0, 0})), IsOk());
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 0.5f}, {2, 5, 0.5f}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("update 5 of worker 2 is incomplete")));
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 0.5f}, {3, 1, 0.5f}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("update 1 of worker 3 is not staged")));
  EXPECT_EQ(shard->version(), 0u);
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(Layer(*shard, 2), (std::vector<float>{4, 5, 6, 7}));
  EXPECT_EQ(shard->staged_count(), 2u);
  EXPECT_TRUE(shard->IsStaged(1, 1));
  EXPECT_FALSE(shard->IsStaged(2, 5));
  // The same version commits once the coordinator sends the order it can satisfy.
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
}

TEST(ShardStateCommitTest, RejectsOutOfOrderCommits) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  EXPECT_THAT(shard->Apply(CommitOrder(2, {{1, 1, 1.0f}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("commit of version 2 on a shard at version 0")));
  EXPECT_THAT(shard->Apply(CommitOrder(0, {{1, 1, 1.0f}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("commit of version 0 on a shard at version 0")));
  EXPECT_EQ(shard->version(), 0u);
  EXPECT_TRUE(shard->IsStaged(1, 1));
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  // A replayed commit is refused too (its updates are gone).
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("commit of version 1 on a shard at version 1")));
}

TEST(ShardStateCommitTest, RejectsMalformedCommits) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  EXPECT_THAT(shard->Apply(CommitOrder(1, {})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no updates")));
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 0.5f}, {1, 1, 0.5f}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, std::numeric_limits<float>::quiet_NaN()}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight")));
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, std::numeric_limits<float>::infinity()}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight")));
  v1::ShardOrder restore;
  restore.set_kind(v1::ShardOrder::RESTORE);
  restore.set_version(0);
  EXPECT_THAT(shard->Apply(restore), StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_THAT(shard->Apply(v1::ShardOrder()), StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_EQ(shard->version(), 0u);
  EXPECT_TRUE(shard->IsStaged(1, 1));
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{1, 2, 3}));
}

TEST(ShardStateCommitTest, DiscardDropsStagedUpdatesOnly) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0);
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Stage(Slice0(2, 1, 0, {1, 1, 0}, {1, 1, 0, 0})), IsOk());
  ASSERT_THAT(shard->Stage(Part0(3, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  v1::ShardOrder discard = CommitOrder(0, {{1, 1, 0}, {2, 1, 0}, {9, 9, 0}});
  discard.set_kind(v1::ShardOrder::DISCARD);
  ASSERT_THAT(shard->Apply(discard), IsOk());
  EXPECT_EQ(shard->staged_count(), 1u);
  EXPECT_TRUE(shard->IsStaged(3, 1));
  EXPECT_EQ(shard->version(), 0u);
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{1, 2, 3}));
  EXPECT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not staged")));
}

// Golden two-step Nesterov (paper 002 Eq. 4: m = beta m + g; theta -= lr (beta m + g)) with
// lr 0.5, beta 0.9, hand-computed: theta1 = theta0 - 0.95 g1,
// theta2 = theta1 - 0.5 (0.9 (0.9 g1 + g2) + g2) = theta0 - 1.355 g1 - 0.95 g2.
TEST(ShardStateNesterovTest, TwoCommitsMatchHandComputedMomentum) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Nesterov());
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 2, -1}, {0.5f, 0, 1, -2})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  EXPECT_THAT(Layer(*shard, 0), Pointwise(FloatNear(1e-5f), {0.05f, 0.1f, 3.95f}));
  EXPECT_THAT(Layer(*shard, 2), Pointwise(FloatNear(1e-5f), {3.525f, 5.0f, 5.05f, 8.9f}));

  // g2 = 0.5 a + 0.5 b = {1, -1, 2.5}, {2, 0, 0, 1}.
  ASSERT_THAT(shard->Stage(Part0(1, 2, {2, 0, 4}, {1, -1, 0, 2})), IsOk());
  ASSERT_THAT(shard->Stage(Part0(2, 1, {0, -2, 1}, {3, 1, 0, 0})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(2, {{1, 2, 0.5f}, {2, 1, 0.5f}})), IsOk());
  EXPECT_THAT(Layer(*shard, 0), Pointwise(FloatNear(1e-5f), {-1.305f, 0.24f, 1.98f}));
  EXPECT_THAT(Layer(*shard, 2), Pointwise(FloatNear(1e-5f), {1.4225f, 5.0f, 4.645f, 8.76f}));
}

// --- Snapshots for pulls

TEST(ShardStateSnapshotTest, KeepsOnlyTheVersionsTheCoordinatorNames) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1));
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}}, /*keep=*/{0})), IsOk());
  EXPECT_THAT(shard->retained_versions(), ElementsAre(0u));
  absl::StatusOr<ModelSnapshot> v0 = shard->SnapshotAt(0);
  ASSERT_THAT(v0, IsOk());
  EXPECT_EQ(v0->version, 0u);
  EXPECT_EQ(*v0->layers[0], (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(*v0->layers[2], (std::vector<float>{4, 5, 6, 7}));
  EXPECT_EQ(v0->layers[1], nullptr);
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{0, 1, 2}));

  // Version 1 is not named for keeping: after commit 2 it is gone, version 0 stays.
  ASSERT_THAT(shard->Stage(Part0(1, 2, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(2, {{1, 2, 1.0f}}, /*keep=*/{0})), IsOk());
  EXPECT_THAT(shard->retained_versions(), ElementsAre(0u));
  EXPECT_THAT(shard->SnapshotAt(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("version 1 is no longer held")));
  EXPECT_EQ(*shard->SnapshotAt(0)->layers[0], (std::vector<float>{1, 2, 3}));
  EXPECT_THAT(shard->SnapshotAt(3), StatusIs(absl::StatusCode::kUnavailable, _));

  // Versions 0 and 2 both kept by commit 3; commit 4 keeps none.
  ASSERT_THAT(shard->Stage(Part0(1, 3, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(3, {{1, 3, 1.0f}}, /*keep=*/{0, 2})), IsOk());
  EXPECT_THAT(shard->retained_versions(), ElementsAre(0u, 2u));
  EXPECT_EQ(*shard->SnapshotAt(2)->layers[0], (std::vector<float>{-1, 0, 1}));
  ASSERT_THAT(shard->Stage(Part0(1, 4, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(4, {{1, 4, 1.0f}})), IsOk());
  EXPECT_THAT(shard->retained_versions(), IsEmpty());
  EXPECT_THAT(shard->SnapshotAt(0), StatusIs(absl::StatusCode::kFailedPrecondition, _));
  EXPECT_THAT(shard->SnapshotAt(2), StatusIs(absl::StatusCode::kFailedPrecondition, _));
  EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{-3, -2, -1}));
}

TEST(ShardStateSnapshotTest, AHeldSnapshotOutlivesTheStep) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Sgd(1));
  absl::StatusOr<ModelSnapshot> pulling = shard->SnapshotAt(0);
  ASSERT_THAT(pulling, IsOk());
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  EXPECT_EQ(*pulling->layers[0], (std::vector<float>{1, 2, 3}));  // a pull in flight is safe
  EXPECT_THAT(shard->SnapshotAt(0), StatusIs(absl::StatusCode::kFailedPrecondition, _));
}

// --- Checkpoints

TEST(ShardStateCheckpointTest, CaptureHoldsTheOwnedLayers) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 1, Nesterov());
  const v1::ShardCheckpoint c = shard->Capture(kFingerprint);
  EXPECT_EQ(c.format(), 1u);
  EXPECT_EQ(c.fingerprint(), kFingerprint);
  EXPECT_EQ(c.shard_index(), 1u);
  EXPECT_EQ(c.shard_processes(), 2u);
  EXPECT_EQ(c.version(), 0u);
  EXPECT_THAT(c.layer_ids(), ElementsAre(1u, 3u));
  ASSERT_EQ(c.layer_params_size(), 2);
  // float32 little-endian: 10.0f = 0x41200000.
  EXPECT_EQ(c.layer_params(0).size(), 8u);
  EXPECT_EQ(c.layer_params(0).substr(0, 4), std::string("\x00\x00\x20\x41", 4));
  EXPECT_EQ(c.layer_params(1).size(), 8u);
  EXPECT_EQ(c.optimizer_state_size(), 2);
}

TEST(ShardStateCheckpointTest, RestoreResumesParametersAndMomentum) {
  InlineExecutor executor;
  auto shard = MakeShard(executor, 0, Nesterov());
  ASSERT_THAT(shard->Stage(Part0(1, 1, {1, 2, -1}, {0.5f, 0, 1, -2})), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  const v1::ShardCheckpoint at1 = shard->Capture(kFingerprint);
  const std::vector<float> embed1 = Layer(*shard, 0);

  // Commit 2 on the original; remember where it lands.
  const PendingUpdate u2 = Part0(1, 2, {1, -1, 2.5f}, {2, 0, 0, 1});
  ASSERT_THAT(shard->Stage(u2), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(2, {{1, 2, 1.0f}}, /*keep=*/{1})), IsOk());
  const std::vector<float> embed2 = Layer(*shard, 0);
  const std::vector<float> block2 = Layer(*shard, 2);
  EXPECT_THAT(embed2, Pointwise(FloatNear(1e-5f), {-1.305f, 0.24f, 1.98f}));

  // Rewind the same shard, with something staged and a version retained: both are dropped.
  ASSERT_THAT(shard->Stage(Part0(3, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(shard->Restore(at1, kFingerprint), IsOk());
  EXPECT_EQ(shard->version(), 1u);
  EXPECT_EQ(shard->staged_count(), 0u);
  EXPECT_THAT(shard->retained_versions(), IsEmpty());
  EXPECT_EQ(Layer(*shard, 0), embed1);
  ASSERT_THAT(shard->Stage(u2), IsOk());
  ASSERT_THAT(shard->Apply(CommitOrder(2, {{1, 2, 1.0f}})), IsOk());
  EXPECT_EQ(Layer(*shard, 0), embed2);  // bit for bit: the momentum came back too
  EXPECT_EQ(Layer(*shard, 2), block2);

  // A fresh process restored from the checkpoint takes the same step.
  auto fresh = MakeShard(executor, 0, Nesterov());
  ASSERT_THAT(fresh->Restore(at1, kFingerprint), IsOk());
  ASSERT_THAT(fresh->Stage(u2), IsOk());
  ASSERT_THAT(fresh->Apply(CommitOrder(2, {{1, 2, 1.0f}})), IsOk());
  EXPECT_EQ(Layer(*fresh, 0), embed2);
  EXPECT_EQ(Layer(*fresh, 2), block2);
}

TEST(ShardStateCheckpointTest, RefusalsLeaveTheStateUnchanged) {
  InlineExecutor executor;
  auto donor = MakeShard(executor, 0, Nesterov());
  ASSERT_THAT(donor->Stage(Part0(1, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  ASSERT_THAT(donor->Apply(CommitOrder(1, {{1, 1, 1.0f}})), IsOk());
  const v1::ShardCheckpoint good = donor->Capture(kFingerprint);

  auto shard = MakeShard(executor, 0, Nesterov());
  ASSERT_THAT(shard->Stage(Part0(2, 1, {1, 1, 1}, {1, 1, 1, 1})), IsOk());
  auto expect_unchanged = [&] {
    EXPECT_EQ(shard->version(), 0u);
    EXPECT_EQ(Layer(*shard, 0), (std::vector<float>{1, 2, 3}));
    EXPECT_EQ(Layer(*shard, 2), (std::vector<float>{4, 5, 6, 7}));
    EXPECT_TRUE(shard->IsStaged(2, 1));
  };

  EXPECT_THAT(shard->Restore(good, "other model"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("other model"), HasSubstr(kFingerprint))));
  expect_unchanged();

  v1::ShardCheckpoint index = good;
  index.set_shard_index(1);
  EXPECT_THAT(shard->Restore(index, kFingerprint),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("of shard 1 of 2 processes, this is shard 0 of 2")));
  expect_unchanged();

  v1::ShardCheckpoint processes = good;
  processes.set_shard_processes(3);
  EXPECT_THAT(shard->Restore(processes, kFingerprint),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("of shard 0 of 3 processes, this is shard 0 of 2")));
  expect_unchanged();

  v1::ShardCheckpoint layers = good;
  layers.set_layer_ids(1, 3);
  EXPECT_THAT(shard->Restore(layers, kFingerprint),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds layers [0, 3]")));
  expect_unchanged();

  v1::ShardCheckpoint short_params = good;
  short_params.mutable_layer_params(1)->resize(12);
  EXPECT_THAT(shard->Restore(short_params, kFingerprint),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2 (blocks.1)")));
  expect_unchanged();

  // The second layer's blob is bad: the first layer's state must not have been loaded either.
  v1::ShardCheckpoint bad_blob = good;
  bad_blob.mutable_optimizer_state(1)->append("x");
  EXPECT_THAT(shard->Restore(bad_blob, kFingerprint),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks.1")));
  expect_unchanged();

  v1::ShardCheckpoint format = good;
  format.set_format(2);
  EXPECT_THAT(shard->Restore(format, kFingerprint),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("format 2")));
  expect_unchanged();

  // The refused attempts left the momentum at zero: one step from version 0 is 0.95 g.
  ASSERT_THAT(shard->Apply(CommitOrder(1, {{2, 1, 1.0f}})), IsOk());
  EXPECT_THAT(Layer(*shard, 0), Pointwise(FloatNear(1e-5f), {0.05f, 1.05f, 2.05f}));
}

// --- The EDiT penalty on a shard (paper 000 Alg. 2, docs/algorithms.md): per owned layer, each
// update scaled by its discount, weights softmax(-||g_i||), clip, SGD. Golden numbers by hand:
//   embed:   w7 = 0.5 * (3, 0, 4) -> norm 2.5, w8 = (0, 1, 0) -> norm 1;
//            weights 1 / (1 + e^1.5) = 0.1824255, 0.8175745; g = (0.2736383, 0.8175745,
//            0.3648511), norm 0.936 < clip 10; embed = (1, 2, 3) - 0.5 g.
//   blocks.1: w7 = 0.5 * (0, 0, 0, 2) -> norm 1, w8 = 0 -> norm 0; weights 0.2689414,
//            0.7310586; g = (0, 0, 0, 0.2689414); blocks.1 = (4, 5, 6, 7 - 0.1344707).
// The entries' weights (0.3) are replaced by the penalty's.
v1::ShardOrder PenaltyCommit() {
  v1::ShardOrder order = CommitOrder(1, {{7, 1, 0.3f}, {8, 1, 0.3f}});
  order.mutable_entries(0)->set_discount(0.5f);
  order.mutable_entries(1)->set_discount(1.0f);
  return order;
}

std::unique_ptr<ShardState> PenaltyShard(Executor& executor) {
  std::unique_ptr<ShardState> shard = MakeShard(executor, 0);
  v1::PenaltyConfig penalty;
  penalty.set_enabled(true);
  penalty.set_ema_alpha(0.02f);
  penalty.set_z_threshold(3);
  penalty.set_warmup(1);
  penalty.set_temperature(1);
  penalty.set_clip_norm(10);
  EXPECT_THAT(shard->EnablePenalty(penalty), IsOk());
  EXPECT_THAT(shard->Stage(Part0(7, 1, {3, 0, 4}, {0, 0, 0, 2})), IsOk());
  EXPECT_THAT(shard->Stage(Part0(8, 1, {0, 1, 0}, {0, 0, 0, 0})), IsOk());
  return shard;
}

TEST(ShardStatePenaltyTest, WeighsByNormsAfterTheDiscount) {
  InlineExecutor executor;
  std::unique_ptr<ShardState> shard = PenaltyShard(executor);
  ASSERT_THAT(shard->Apply(PenaltyCommit()), IsOk());
  EXPECT_THAT(Layer(*shard, 0), Pointwise(FloatNear(1e-6), {0.8631809f, 1.5912128f, 2.8175745f}));
  EXPECT_THAT(Layer(*shard, 2), Pointwise(FloatNear(1e-6), {4.0f, 5.0f, 6.0f, 6.8655293f}));
  ASSERT_EQ(shard->last_penalty_reports().size(), 2u);  // one per owned layer
  EXPECT_NEAR(shard->last_penalty_reports()[0].updates[0].norm, 2.5, 1e-6);
  EXPECT_NEAR(shard->last_penalty_reports()[0].updates[0].weight, 0.1824255, 1e-6);
  EXPECT_FALSE(shard->last_penalty_reports()[0].rollback);
}

TEST(ShardStatePenaltyTest, RejectsADiscountOutsideZeroOneAndChangesNothing) {
  InlineExecutor executor;
  std::unique_ptr<ShardState> shard = PenaltyShard(executor);
  for (float bad : {0.0f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    v1::ShardOrder order = PenaltyCommit();
    order.mutable_entries(0)->set_discount(bad);
    EXPECT_THAT(shard->Apply(order), StatusIs(absl::StatusCode::kInvalidArgument, _)) << bad;
  }
  EXPECT_EQ(shard->version(), 0u);
  EXPECT_TRUE(shard->IsStaged(7, 1));
  ASSERT_THAT(shard->Apply(PenaltyCommit()), IsOk());  // the staged copies were not scaled
  EXPECT_THAT(Layer(*shard, 0), Pointwise(FloatNear(1e-6), {0.8631809f, 1.5912128f, 2.8175745f}));
}

TEST(ShardStatePenaltyTest, StatisticsTravelInCheckpointsAndForgetDropsThem) {
  InlineExecutor executor;
  std::unique_ptr<ShardState> shard = PenaltyShard(executor);
  ASSERT_THAT(shard->Apply(PenaltyCommit()), IsOk());
  const v1::ShardCheckpoint with_both = shard->Capture(kFingerprint);
  EXPECT_FALSE(with_both.penalty_state().empty());

  // A restored shard weighs the next updates exactly as the original: the statistics came along.
  std::unique_ptr<ShardState> restored = PenaltyShard(executor);
  ASSERT_THAT(restored->Restore(with_both, kFingerprint), IsOk());
  for (ShardState* s : {shard.get(), restored.get()}) {
    ASSERT_THAT(s->Stage(Part0(7, 2, {1, 1, 1}, {1, 0, 0, 0})), IsOk());
    v1::ShardOrder next = CommitOrder(2, {{7, 2, 1.0f}});
    next.mutable_entries(0)->set_discount(1.0f);
    ASSERT_THAT(s->Apply(next), IsOk());
  }
  EXPECT_EQ(Layer(*shard, 0), Layer(*restored, 0));
  EXPECT_EQ(shard->Capture(kFingerprint).SerializeAsString(),
            restored->Capture(kFingerprint).SerializeAsString());

  // FORGET drops a worker's statistics: the checkpoint's penalty state shrinks.
  v1::ShardOrder forget;
  forget.set_kind(v1::ShardOrder::FORGET);
  forget.add_entries()->set_worker_id(7);
  const size_t before = shard->Capture(kFingerprint).penalty_state().size();
  ASSERT_THAT(shard->Apply(forget), IsOk());
  EXPECT_LT(shard->Capture(kFingerprint).penalty_state().size(), before);
  EXPECT_EQ(shard->version(), 2u);

  // A checkpoint without penalty state (taken with the penalty off) starts them afresh; a
  // malformed one is refused and changes nothing.
  v1::ShardCheckpoint corrupt = with_both;
  corrupt.set_penalty_state("garbage");
  EXPECT_THAT(shard->Restore(corrupt, kFingerprint),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("penalty state")));
  EXPECT_EQ(shard->version(), 2u);
  v1::ShardCheckpoint without = with_both;
  without.clear_penalty_state();
  ASSERT_THAT(shard->Restore(without, kFingerprint), IsOk());
  EXPECT_EQ(shard->version(), 1u);
}

}  // namespace
}  // namespace aloe::server
