#include "server/core/parameter_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

v1::ModelSpec TwoLayerSpec() {
  v1::ModelSpec spec;
  spec.set_num_shards(2);  // two apply groups, one layer each
  for (uint32_t i = 0; i < 2; ++i) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(i);
    layer->set_name(i == 0 ? "a" : "b");
    layer->set_num_elements(i == 0 ? 3 : 2);
    layer->set_shard(i);
  }
  return spec;
}

std::unique_ptr<ParameterStore> MakeStore(Executor& executor) {
  v1::OuterOptimizerConfig sgd;
  sgd.set_type(v1::OUTER_SGD);
  sgd.set_lr(0.5f);
  auto store = ParameterStore::Create(TwoLayerSpec(), {{1, 2, 3}, {4, 5}}, sgd, executor);
  EXPECT_THAT(store, IsOk());
  return *std::move(store);
}

PendingUpdate Update(std::vector<float> a, std::vector<float> b) {
  PendingUpdate u;
  u.layers = {std::move(a), std::move(b)};
  return u;
}

TEST(ParameterStoreTest, WeightedOuterStepAcrossShards) {
  ThreadPoolExecutor executor(1);
  auto store = MakeStore(executor);
  const PendingUpdate u1 = Update({1, 1, 1}, {2, 2});
  const PendingUpdate u2 = Update({3, 0, -1}, {0, 4});
  ASSERT_THAT(store->ApplyOuterStep({&u1, &u2}, {0.25f, 0.75f}), IsOk());
  EXPECT_EQ(store->version(), 1u);
  // g = 0.25 u1 + 0.75 u2 = {2.5, 0.25, -0.5}, {0.5, 3.5}; theta -= 0.5 g.
  const ModelSnapshot s = store->Snapshot();
  EXPECT_THAT(*s.layers[0], ::testing::Pointwise(::testing::FloatEq(), {-0.25f, 1.875f, 3.25f}));
  EXPECT_THAT(*s.layers[1], ::testing::Pointwise(::testing::FloatEq(), {3.75f, 3.25f}));
}

TEST(ParameterStoreTest, SnapshotsAreImmutableWhileTheModelMovesOn) {
  InlineExecutor executor;
  auto store = MakeStore(executor);
  const ModelSnapshot before = store->Snapshot();
  const PendingUpdate u = Update({2, 2, 2}, {2, 2});
  ASSERT_THAT(store->ApplyOuterStep({&u}, {1.0f}), IsOk());
  EXPECT_EQ(before.version, 0u);
  EXPECT_EQ(*before.layers[0], (std::vector<float>{1, 2, 3}));  // held copy untouched
  EXPECT_EQ(*store->Snapshot().layers[0], (std::vector<float>{0, 1, 2}));
}

TEST(ParameterStoreTest, WrongShapesChangeNothing) {
  InlineExecutor executor;
  auto store = MakeStore(executor);
  const PendingUpdate good = Update({1, 1, 1}, {1, 1});
  const PendingUpdate bad = Update({1, 1, 1}, {1});
  EXPECT_THAT(store->ApplyOuterStep({&good, &bad}, {0.5f, 0.5f}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 1 (b)")));
  EXPECT_EQ(store->version(), 0u);
  EXPECT_EQ(*store->Snapshot().layers[0], (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(*store->Snapshot().layers[1], (std::vector<float>{4, 5}));
}

// A lone update of weight 1 is applied from its own buffer: no layer gets an aggregation buffer
// until a step aggregates (memory bound of a plain-async server or shard process: one model copy
// fewer).
TEST(ParameterStoreTest, AggregationBuffersAppearOnlyWithTheFirstAggregatedStep) {
  InlineExecutor executor;
  auto store = MakeStore(executor);
  EXPECT_EQ(store->scratch_bytes(), 0u);
  const PendingUpdate u = Update({2, 2, 2}, {2, 2});
  ASSERT_THAT(store->ApplyOuterStep({&u}, {1.0f}), IsOk());
  EXPECT_EQ(store->scratch_bytes(), 0u);
  EXPECT_EQ(*store->Snapshot().layers[0], (std::vector<float>{0, 1, 2}));
  // Weight 0.5: aggregated, so every layer now has its buffer (5 floats in all).
  ASSERT_THAT(store->ApplyOuterStep({&u}, {0.5f}), IsOk());
  EXPECT_EQ(store->scratch_bytes(), 5 * sizeof(float));
  EXPECT_THAT(*store->Snapshot().layers[0],
              ::testing::Pointwise(::testing::FloatEq(), {-0.5f, 0.5f, 1.5f}));
  EXPECT_THAT(*store->Snapshot().layers[1],
              ::testing::Pointwise(::testing::FloatEq(), {2.5f, 3.5f}));
  // Two updates: the buffers are reused, g = 0.25 * 2 + 0.75 * 2 = 2 per element.
  ASSERT_THAT(store->ApplyOuterStep({&u, &u}, {0.25f, 0.75f}), IsOk());
  EXPECT_EQ(store->scratch_bytes(), 5 * sizeof(float));
  EXPECT_THAT(*store->Snapshot().layers[1],
              ::testing::Pointwise(::testing::FloatEq(), {1.5f, 2.5f}));
}

// A layer nobody else holds is updated in place; one that a snapshot still holds (an older
// version kept for pulls) gets a fresh buffer, and the snapshot keeps the old values.
TEST(ParameterStoreTest, CountsTheLayerUpdatesThatCopy) {
  InlineExecutor executor;
  auto store = MakeStore(executor);
  const PendingUpdate u = Update({2, 2, 2}, {2, 2});
  const float* before = store->Snapshot().layers[0]->data();
  ASSERT_THAT(store->ApplyOuterStep({&u}, {1.0f}), IsOk());
  EXPECT_EQ(store->layer_steps(), 2u);
  EXPECT_EQ(store->copied_layer_steps(), 0u);
  EXPECT_EQ(store->Snapshot().layers[0]->data(), before);  // in place
  {
    const ModelSnapshot held = store->Snapshot();
    ASSERT_THAT(store->ApplyOuterStep({&u}, {1.0f}), IsOk());
    EXPECT_EQ(store->layer_steps(), 4u);
    EXPECT_EQ(store->copied_layer_steps(), 2u);
    EXPECT_NE(store->Snapshot().layers[0]->data(), held.layers[0]->data());
    EXPECT_EQ(*held.layers[0], (std::vector<float>{0, 1, 2}));
  }
  ASSERT_THAT(store->ApplyOuterStep({&u}, {1.0f}), IsOk());  // nothing held any more
  EXPECT_EQ(store->layer_steps(), 6u);
  EXPECT_EQ(store->copied_layer_steps(), 2u);
}

}  // namespace
}  // namespace aloe::server
