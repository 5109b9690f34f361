#include "server/core/checkpoint_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/executor.h"
#include "common/model_spec.h"
#include "common/status_matchers.h"
#include "common/tensor_codec.h"
#include "server/core/parameter_store.h"
#include "server/core/pseudo_gradient_penalty.h"
#include "server/core/shard_state.h"
#include "tests/testing/shard_orders.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ModuleStats = PseudoGradientPenalty::ModuleStats;

// Five layers of 10, 40, 30, 20 and 5 elements.
v1::ModelSpec FiveLayers(uint32_t processes) {
  v1::ModelSpec spec;
  const uint64_t sizes[] = {10, 40, 30, 20, 5};
  for (uint32_t i = 0; i < 5; ++i) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(i);
    layer->set_name("layer" + std::to_string(i));
    layer->set_num_elements(sizes[i]);
  }
  AssignShards(processes, &spec);
  return spec;
}

std::string Floats(size_t n, float first) {
  std::vector<float> values(n);
  for (size_t k = 0; k < n; ++k) values[k] = first + static_cast<float>(k);
  std::string bytes;
  AppendFloats(values, &bytes);
  return bytes;
}

// Statistics that name their module: stream 100 + m with mu m + 0.5, and for odd m a second
// stream 7.
std::vector<ModuleStats> NamedStats(size_t modules) {
  std::vector<ModuleStats> stats(modules);
  for (size_t m = 0; m < modules; ++m) {
    stats[m][100 + m] = PenaltyEmaStats{m + 0.5, 0.25, m + 1};
    if (m % 2 == 1) stats[m][7] = PenaltyEmaStats{1.5, 0.5, 3};
  }
  return stats;
}

// A one-process checkpoint of FiveLayers: layer l's values start at 1000 l, its optimizer state
// is "state-l", and the penalty statistics are NamedStats.
v1::ServerCheckpoint Whole() {
  v1::ServerCheckpoint c;
  c.set_format(1);
  c.set_fingerprint("whole");
  c.set_version(12);
  c.set_updates_applied(30);
  c.set_next_task_id(41);
  c.set_next_worker_id(9);
  const v1::ModelSpec spec = FiveLayers(1);
  for (int l = 0; l < 5; ++l) {
    *c.add_layer_params() = Floats(spec.layers(l).num_elements(), 1000.0f * l);
    c.add_optimizer_state("state-" + std::to_string(l));
  }
  PseudoGradientPenalty::WriteState(NamedStats(5), c.mutable_penalty_state());
  c.add_shard_steps(3);
  c.add_shard_tokens(3000);
  c.set_sampler_rng("rng");
  c.add_eval_versions(10);
  c.add_eval_losses(2.5);
  c.set_trained_seconds(77.5);
  return c;
}

TEST(CheckpointLayoutTest, SplitGivesEachShardProcessItsLayersStatesAndStatistics) {
  // Greedy byte balancing over 2 processes: 40 -> 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0
  // (40 < 50), 5 -> 0 (50 = 50, the lower index).
  const v1::ModelSpec spec = FiveLayers(2);
  absl::StatusOr<ShardedCheckpoint> split = SplitCheckpoint(spec, Whole());
  ASSERT_THAT(split, IsOk());
  ASSERT_EQ(split->shards.size(), 2u);
  const v1::ShardCheckpoint& s0 = split->shards[0];
  const v1::ShardCheckpoint& s1 = split->shards[1];
  EXPECT_THAT(s0.layer_ids(), ElementsAre(0u, 1u, 4u));
  EXPECT_THAT(s1.layer_ids(), ElementsAre(2u, 3u));
  EXPECT_EQ(s0.shard_index(), 0u);
  EXPECT_EQ(s1.shard_index(), 1u);
  EXPECT_EQ(s1.shard_processes(), 2u);
  EXPECT_EQ(s0.version(), 12u);
  EXPECT_EQ(s1.version(), 12u);
  EXPECT_EQ(s0.format(), 1u);
  EXPECT_EQ(s0.fingerprint(), "");  // the caller's to set
  EXPECT_THAT(s0.optimizer_state(), ElementsAre("state-0", "state-1", "state-4"));
  EXPECT_THAT(s1.optimizer_state(), ElementsAre("state-2", "state-3"));
  EXPECT_EQ(s0.layer_params(1), Floats(40, 1000));
  EXPECT_EQ(s0.layer_params(2), Floats(5, 4000));
  EXPECT_EQ(s1.layer_params(0), Floats(30, 2000));
  // Shard 1's penalty modules are layers 2 and 3: streams 102 and 103 (+ 7 for the odd one).
  absl::StatusOr<std::vector<ModuleStats>> p1 =
      PseudoGradientPenalty::ParseState(s1.penalty_state());
  ASSERT_THAT(p1, IsOk());
  ASSERT_EQ(p1->size(), 2u);
  EXPECT_EQ((*p1)[0].size(), 1u);
  EXPECT_DOUBLE_EQ((*p1)[0].at(102).mu, 2.5);
  EXPECT_EQ((*p1)[1].at(103).count, 4u);
  EXPECT_DOUBLE_EQ((*p1)[1].at(7).sigma, 0.5);
  // The coordinator keeps everything but the layers.
  const v1::ServerCheckpoint& c = split->coordinator;
  EXPECT_EQ(c.layer_params_size(), 0);
  EXPECT_EQ(c.optimizer_state_size(), 0);
  EXPECT_TRUE(c.penalty_state().empty());
  EXPECT_EQ(c.version(), 12u);
  EXPECT_EQ(c.next_task_id(), 41u);
  EXPECT_EQ(c.next_worker_id(), 9u);
  EXPECT_EQ(c.sampler_rng(), "rng");
  EXPECT_DOUBLE_EQ(c.trained_seconds(), 77.5);
  EXPECT_EQ(c.fingerprint(), "whole");
}

TEST(CheckpointLayoutTest, JoinUndoesSplitForEveryProcessCount) {
  const v1::ServerCheckpoint whole = Whole();
  for (uint32_t processes : {1u, 2u, 3u, 5u}) {
    SCOPED_TRACE(processes);
    const v1::ModelSpec spec = FiveLayers(processes);
    absl::StatusOr<ShardedCheckpoint> split = SplitCheckpoint(spec, whole);
    ASSERT_THAT(split, IsOk());
    EXPECT_EQ(split->shards.size(), processes);
    absl::StatusOr<v1::ServerCheckpoint> joined = JoinShardCheckpoints(spec, *split);
    ASSERT_THAT(joined, IsOk());
    EXPECT_EQ(joined->SerializeAsString(), whole.SerializeAsString());
  }
}

TEST(CheckpointLayoutTest, TwoToThreeProcessesMovesEveryLayerToItsNewOwner) {
  absl::StatusOr<ShardedCheckpoint> two = SplitCheckpoint(FiveLayers(2), Whole());
  ASSERT_THAT(two, IsOk());
  absl::StatusOr<v1::ServerCheckpoint> joined = JoinShardCheckpoints(FiveLayers(2), *two);
  ASSERT_THAT(joined, IsOk());
  // 3 processes: 40 -> 0, 30 -> 1, 20 -> 2, 10 -> 2 (20 < 30), 5 -> 1 (30 = 30, lower index).
  absl::StatusOr<ShardedCheckpoint> three = SplitCheckpoint(FiveLayers(3), *joined);
  ASSERT_THAT(three, IsOk());
  EXPECT_THAT(three->shards[0].layer_ids(), ElementsAre(1u));
  EXPECT_THAT(three->shards[1].layer_ids(), ElementsAre(2u, 4u));
  EXPECT_THAT(three->shards[2].layer_ids(), ElementsAre(0u, 3u));
  EXPECT_THAT(three->shards[2].optimizer_state(), ElementsAre("state-0", "state-3"));
  EXPECT_EQ(three->shards[1].layer_params(1), Floats(5, 4000));
}

TEST(CheckpointLayoutTest, AShardWithoutStatisticsJoinsWithFreshOnes) {
  absl::StatusOr<ShardedCheckpoint> split = SplitCheckpoint(FiveLayers(2), Whole());
  ASSERT_THAT(split, IsOk());
  split->shards[1].clear_penalty_state();
  absl::StatusOr<v1::ServerCheckpoint> joined = JoinShardCheckpoints(FiveLayers(2), *split);
  ASSERT_THAT(joined, IsOk());
  absl::StatusOr<std::vector<ModuleStats>> p =
      PseudoGradientPenalty::ParseState(joined->penalty_state());
  ASSERT_THAT(p, IsOk());
  ASSERT_EQ(p->size(), 5u);
  EXPECT_EQ((*p)[1].size(), 2u);  // shard 0's layer 1
  EXPECT_TRUE((*p)[2].empty());   // shard 1's
  EXPECT_TRUE((*p)[3].empty());
  // No shard with statistics: none.
  split->shards[0].clear_penalty_state();
  joined = JoinShardCheckpoints(FiveLayers(2), *split);
  ASSERT_THAT(joined, IsOk());
  EXPECT_TRUE(joined->penalty_state().empty());
}

TEST(CheckpointLayoutTest, InconsistentShardCheckpointsAreRefusedNamingTheProblem) {
  const v1::ModelSpec spec = FiveLayers(2);
  absl::StatusOr<ShardedCheckpoint> good = SplitCheckpoint(spec, Whole());
  ASSERT_THAT(good, IsOk());
  auto join_with = [&](auto change) {
    ShardedCheckpoint bad = *good;
    change(bad);
    return JoinShardCheckpoints(spec, bad).status();
  };
  constexpr absl::StatusCode kInvalidArgument = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(
      join_with([](ShardedCheckpoint& b) { b.shards[1].set_version(10); }),
      StatusIs(kInvalidArgument,
               HasSubstr("shard 1's checkpoint is of version 10, the coordinator's of 12")));
  EXPECT_THAT(
      join_with([](ShardedCheckpoint& b) { b.shards.pop_back(); }),
      StatusIs(kInvalidArgument, HasSubstr("1 shard checkpoints for a model assigned to 2")));
  EXPECT_THAT(join_with([](ShardedCheckpoint& b) { std::swap(b.shards[0], b.shards[1]); }),
              StatusIs(kInvalidArgument, HasSubstr("says it is shard 1 of 2 processes")));
  EXPECT_THAT(join_with([](ShardedCheckpoint& b) { b.shards[0].set_shard_processes(3); }),
              StatusIs(kInvalidArgument, HasSubstr("shard 0 of 3 processes")));
  EXPECT_THAT(
      join_with([](ShardedCheckpoint& b) { b.shards[1].set_layer_ids(1, 4); }),
      StatusIs(kInvalidArgument, HasSubstr("holds layers [2, 4], the model assigns it [2, 3]")));
  EXPECT_THAT(
      join_with([](ShardedCheckpoint& b) { b.shards[0].mutable_layer_params(2)->pop_back(); }),
      StatusIs(kInvalidArgument, HasSubstr("layer 4 (layer4): 19 parameter bytes, expected 20")));
  EXPECT_THAT(
      join_with([](ShardedCheckpoint& b) { b.shards[1].mutable_optimizer_state()->RemoveLast(); }),
      StatusIs(kInvalidArgument, HasSubstr("2 layers, 2 parameter buffers and 1 optimizer")));
  EXPECT_THAT(join_with([](ShardedCheckpoint& b) {
                b.shards[1].clear_penalty_state();
                PseudoGradientPenalty::WriteState(NamedStats(3),
                                                  b.shards[1].mutable_penalty_state());
              }),
              StatusIs(kInvalidArgument, HasSubstr("penalty statistics of 3 layers, it owns 2")));
  EXPECT_THAT(join_with([](ShardedCheckpoint& b) { b.shards[0].set_penalty_state("junk"); }),
              StatusIs(kInvalidArgument, HasSubstr("shard 0's checkpoint: penalty state")));
  EXPECT_THAT(join_with([](ShardedCheckpoint& b) { b.coordinator = Whole(); }),
              StatusIs(kInvalidArgument, HasSubstr("written by a one-process server")));
}

TEST(CheckpointLayoutTest, ACheckpointThatIsNotOfTheModelDoesNotSplit) {
  constexpr absl::StatusCode kInvalidArgument = absl::StatusCode::kInvalidArgument;
  v1::ServerCheckpoint c = Whole();
  c.mutable_layer_params(3)->append("x");
  EXPECT_THAT(SplitCheckpoint(FiveLayers(2), c).status(),
              StatusIs(kInvalidArgument, HasSubstr("layer 3 (layer3): 81 parameter bytes")));
  c = Whole();
  c.clear_layer_params();
  c.clear_optimizer_state();
  EXPECT_THAT(SplitCheckpoint(FiveLayers(2), c).status(),
              StatusIs(kInvalidArgument, HasSubstr("a coordinator's checkpoint holds none")));
  c = Whole();
  c.clear_penalty_state();
  PseudoGradientPenalty::WriteState(NamedStats(4), c.mutable_penalty_state());
  EXPECT_THAT(SplitCheckpoint(FiveLayers(2), c).status(),
              StatusIs(kInvalidArgument, HasSubstr("penalty statistics of 4 layers, the model 5")));
}

// --- Training goes on exactly: a model trained on 2 shard processes, its checkpoint moved to 3
// processes and to one process, then one more outer step on each layout gives the same
// parameters as the 2 processes stepping on without a checkpoint.

PendingUpdate Update(const v1::ModelSpec& spec, uint64_t worker, uint64_t id, uint32_t shard,
                     bool whole) {
  PendingUpdate u;
  u.worker_id = worker;
  u.update_id = id;
  u.task_id = id;
  u.steps_done = 10;
  u.layers.resize(spec.layers_size());
  for (int l = 0; l < spec.layers_size(); ++l) {
    if (!whole && spec.layers(l).shard() != shard) continue;
    for (uint64_t k = 0; k < spec.layers(l).num_elements(); ++k) {
      u.layers[l].push_back(0.01f * static_cast<float>((id * 7 + l * 3 + k) % 11) - 0.05f);
    }
  }
  return u;
}

std::vector<std::vector<float>> Initial(const v1::ModelSpec& spec) {
  std::vector<std::vector<float>> initial;
  for (const v1::LayerSpec& layer : spec.layers()) {
    initial.emplace_back(layer.num_elements(), 0.25f * static_cast<float>(layer.id()));
  }
  return initial;
}

struct Processes {
  std::vector<std::unique_ptr<ShardState>> shards;

  Processes(const v1::ModelSpec& spec, const v1::OuterOptimizerConfig& optimizer,
            Executor& executor) {
    for (uint32_t i = 0; i < spec.num_shards(); ++i) {
      auto s = ShardState::Create(spec, i, Initial(spec), optimizer, 2, 4, executor);
      EXPECT_THAT(s, IsOk());
      shards.push_back(*std::move(s));
    }
  }
  void Step(const v1::ModelSpec& spec, uint64_t id) {
    for (auto& shard : shards) {
      ASSERT_THAT(shard->Stage(Update(spec, 1, id, shard->shard_index(), false)), IsOk());
      ASSERT_THAT(shard->Apply(::aloe::testing::CommitOrder(shard->version() + 1, {{1, id, 1.0f}})),
                  IsOk());
    }
  }
  std::vector<float> Layer(uint32_t l) const {
    for (const auto& shard : shards) {
      absl::StatusOr<ModelSnapshot> s = shard->SnapshotAt(shard->version());
      if (s.ok() && s->layers[l] != nullptr) return *s->layers[l];
    }
    return {};
  }
};

TEST(CheckpointLayoutTest, TrainingContinuesBitForBitAfterMovingToAnotherLayout) {
  InlineExecutor executor;
  v1::OuterOptimizerConfig nesterov;
  nesterov.set_type(v1::OUTER_NESTEROV);
  nesterov.set_lr(0.7f);
  nesterov.set_momentum(0.9f);
  const v1::ModelSpec two = FiveLayers(2);
  Processes original(two, nesterov, executor);
  for (uint64_t id = 1; id <= 3; ++id) original.Step(two, id);  // momentum is non-zero now

  ShardedCheckpoint saved;
  saved.coordinator.set_format(1);
  saved.coordinator.set_version(3);
  for (const auto& shard : original.shards) saved.shards.push_back(shard->Capture("two"));
  absl::StatusOr<v1::ServerCheckpoint> whole = JoinShardCheckpoints(two, saved);
  ASSERT_THAT(whole, IsOk());

  // Three shard processes.
  const v1::ModelSpec three = FiveLayers(3);
  absl::StatusOr<ShardedCheckpoint> moved = SplitCheckpoint(three, *whole);
  ASSERT_THAT(moved, IsOk());
  Processes resumed(three, nesterov, executor);
  for (uint32_t i = 0; i < 3; ++i) {
    moved->shards[i].set_fingerprint("three");
    ASSERT_THAT(resumed.shards[i]->Restore(moved->shards[i], "three"), IsOk());
    EXPECT_EQ(resumed.shards[i]->version(), 3u);
  }
  // One process.
  std::vector<std::vector<float>> params(5);
  for (int l = 0; l < 5; ++l) {
    params[l].resize(two.layers(l).num_elements());
    ASSERT_THAT(DecodeFloats(whole->layer_params(l), absl::MakeSpan(params[l])), IsOk());
  }
  auto single = ParameterStore::Create(FiveLayers(1), Initial(two), nesterov, executor);
  ASSERT_THAT(single, IsOk());
  ASSERT_THAT((*single)->Restore(
                  3, params, {whole->optimizer_state().begin(), whole->optimizer_state().end()}),
              IsOk());

  original.Step(two, 4);
  resumed.Step(three, 4);
  const PendingUpdate fourth = Update(two, 1, 4, 0, /*whole=*/true);
  ASSERT_THAT((*single)->ApplyOuterStep({&fourth}, {1.0f}), IsOk());
  const ModelSnapshot one = (*single)->Snapshot();
  for (uint32_t l = 0; l < 5; ++l) {
    SCOPED_TRACE(l);
    const std::vector<float> expected = original.Layer(l);
    ASSERT_EQ(expected.size(), two.layers(l).num_elements());
    EXPECT_NE(expected, params[l]);  // the step changed it
    EXPECT_EQ(resumed.Layer(l), expected);
    EXPECT_EQ(*one.layers[l], expected);
  }
}

}  // namespace
}  // namespace aloe::server
