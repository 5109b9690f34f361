// Layer groups (partial synchronization) on a layer-sharded server: the coordinator's core
// (ShardCommitLog) and two ShardStates, fed the way the services feed them. A group's update is
// committed only once every shard process that owns a layer of the group staged its part, the
// COMMIT names the group, and every shard process counts it (a shard without layers of the
// group without a part). The shard processes must end bit-identical to one ParameterStore that
// replays the committed group steps, with every group's version equal everywhere.
#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status_matchers.h"
#include "server/core/checkpoint_layout.h"
#include "server/core/server_core.h"
#include "server/core/shard_commit_log.h"
#include "server/core/shard_state.h"
#include "server/core/update_assembler.h"
#include "tests/testing/server_core_calls.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::HasSubstr;

using UpdateKey = std::pair<uint64_t, uint64_t>;  // (worker_id, update_id)

constexpr uint32_t kGroups = 3;

class ShardedLayerGroupsTest : public ::testing::Test {
 protected:
  // Asynchronous Delayed Nesterov (N = 2) over two shard processes, every push its own step.
  void SetUp() override {
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
        R"(model { vocab_size: 16 seq_len: 8 d_model: 8 num_layers: 4 num_heads: 2 }
           corpus_dir: "unused" local_steps: 4 shard_processes: 2
           aggregation { mode: AGGREGATION_ASYNC min_workers: 1 grace_seconds: 0 }
           outer_optimizer { type: OUTER_DELAYED_NESTEROV lr: 0.7 momentum: 0.9
                             dn_buffer_size: 2 staleness_exponent: 0.5 }
           partial_sync { groups: 3 })",
        &config_));
    FillServerDefaults(&config_);
    ASSERT_THAT(ValidateServerConfig(config_), IsOk());
    auto core = ServerCore::Create(config_, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                   "heldout.tok", clock_, executor_, metrics_);
    ASSERT_THAT(core, IsOk());
    core_ = *std::move(core);
    for (uint32_t s = 0; s < 2; ++s)
      core_->SetShardAddress(s, absl::StrCat("127.0.0.1:", 7001 + s));
    const v1::ModelSpec& spec = core_->spec();
    ASSERT_EQ(spec.num_shards(), 2u);
    std::vector<std::vector<float>> initial;
    for (const v1::LayerSpec& layer : spec.layers()) {
      std::vector<float>& values = initial.emplace_back(layer.num_elements());
      for (size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * (layer.id() + 1) - 0.003f * i;
    }
    for (uint32_t s = 0; s < 2; ++s) {
      auto shard =
          ShardState::Create(spec, s, initial, config_.outer_optimizer(), 1,
                             config_.max_staged_updates(), executor_, core_->layer_groups());
      ASSERT_THAT(shard, IsOk());
      shards_.push_back(*std::move(shard));
    }
    // The replay: the whole model in one store, one apply group.
    v1::ModelSpec whole = spec;
    whole.set_num_shards(1);
    for (v1::LayerSpec& layer : *whole.mutable_layers()) layer.set_shard(0);
    auto store = ParameterStore::Create(whole, initial, config_.outer_optimizer(), executor_,
                                        core_->layer_groups());
    ASSERT_THAT(store, IsOk());
    replay_ = *std::move(store);
  }

  uint64_t Join() { return ::aloe::testing::JoinTrainer(*core_); }
  v1::Task Request(uint64_t worker, std::optional<uint32_t> group = std::nullopt) {
    return ::aloe::testing::RequestTaskOf(*core_, worker, group);
  }

  // Whether shard process `s` owns a layer of `group`.
  bool Owns(uint32_t s, uint32_t group) const {
    for (const v1::LayerSpec& layer : core_->spec().layers()) {
      if (layer.shard() == s && core_->layer_groups()[layer.id()] == group) return true;
    }
    return false;
  }

  // `worker` pushes `group` of `task`, based on the group version its StartGroup granted: a
  // part to each shard process that owns a layer of the group, in shard order, each admitted,
  // staged and reported as the shard service does. Values differ per worker, update, layer and
  // element. cut_after: the push ends after that shard's part (the worker died). Returns the
  // last reply, then applies the orders the coordinator appended.
  absl::StatusOr<v1::PushReply> PushGroup(uint64_t worker, const v1::Task& task, uint32_t group,
                                          bool task_continues,
                                          std::optional<uint32_t> cut_after = std::nullopt) {
    return PushTaken(worker, task, group, Take(worker, group), task_continues, cut_after);
  }

  // StartGroup: the group version granted.
  uint64_t Take(uint64_t worker, uint32_t group) {
    const v1::Task granted = Request(worker, group);
    EXPECT_EQ(granted.kind(), v1::Task::TRAIN);
    return granted.group_versions_size() > 0 ? granted.group_versions(0) : 0;
  }

  // PushGroup of a group taken at version `base`.
  absl::StatusOr<v1::PushReply> PushTaken(uint64_t worker, const v1::Task& task, uint32_t group,
                                          uint64_t base, bool task_continues,
                                          std::optional<uint32_t> cut_after = std::nullopt) {
    v1::PushHeader header;
    header.set_worker_id(worker);
    header.set_task_id(task.task_id());
    header.set_update_id(++update_ids_);
    header.set_base_version(base);
    header.set_steps_done(task.local_steps());
    header.set_tokens_learned(100);
    header.set_compute_seconds(1.0);
    header.set_group(group);
    header.set_task_continues(task_continues);
    PendingUpdate whole = UpdateOfHeader(header);
    whole.by_group = true;
    const v1::ModelSpec& spec = core_->spec();
    for (const v1::LayerSpec& layer : spec.layers()) {
      std::vector<float>& values = whole.layers.emplace_back();
      if (core_->layer_groups()[layer.id()] != group) continue;
      values.resize(layer.num_elements());
      for (size_t i = 0; i < values.size(); ++i) {
        values[i] = 0.05f * static_cast<float>(worker) - 0.01f * static_cast<float>(update_ids_) +
                    0.002f * static_cast<float>(layer.id()) - 0.001f * static_cast<float>(i % 5);
      }
    }
    absl::StatusOr<v1::PushReply> reply = absl::InternalError("no shard owns the group");
    for (uint32_t s = 0; s < 2; ++s) {
      if (!Owns(s, group)) continue;
      PendingUpdate part = whole;
      for (const v1::LayerSpec& layer : spec.layers()) {
        if (layer.shard() != s) part.layers[layer.id()].clear();
      }
      absl::StatusOr<bool> admitted = core_->AdmitPush(header);
      if (!admitted.ok()) return admitted.status();
      EXPECT_TRUE(*admitted);
      absl::StatusOr<StageResult> staged = shards_[s]->Stage(std::move(part));
      EXPECT_THAT(staged, IsOk());
      reply = core_->SubmitShardPart(s, header);
      if (!reply.ok() || cut_after == s) break;
    }
    updates_[UpdateKey(worker, header.update_id())] = std::move(whole);
    Follow();
    return reply;
  }

  // Every shard process applies the orders appended since the last call, and COMMITs are
  // replayed on the one store.
  void Follow() {
    const ShardCommitLog& log = *core_->shard_log();
    for (; next_order_ < log.first_order_index() + log.orders().size(); ++next_order_) {
      const v1::ShardOrder& order = log.orders()[next_order_ - log.first_order_index()];
      for (auto& shard : shards_) ASSERT_THAT(shard->Apply(order), IsOk()) << order.DebugString();
      if (order.kind() != v1::ShardOrder::COMMIT) {
        orders_seen_.push_back(order);
        continue;
      }
      ASSERT_TRUE(order.by_group()) << "with layer groups every COMMIT names its group";
      std::vector<const PendingUpdate*> updates;
      std::vector<float> weights;
      for (const v1::CommitEntry& e : order.entries()) {
        const UpdateKey key(e.worker_id(), e.update_id());
        ASSERT_EQ(updates_.count(key), 1u);
        ASSERT_EQ(updates_[key].group, order.layer_group());
        updates.push_back(&updates_[key]);
        weights.push_back(e.weight());
        committed_.insert(key);
      }
      ASSERT_THAT(replay_->ApplyOuterStep(updates, weights), IsOk());
      orders_seen_.push_back(order);
    }
  }

  v1::ServerConfig config_;
  FakeClock clock_;
  InlineExecutor executor_;
  RecordingMetrics metrics_;
  std::unique_ptr<ServerCore> core_;
  std::vector<std::unique_ptr<ShardState>> shards_;
  std::unique_ptr<ParameterStore> replay_;
  std::map<UpdateKey, PendingUpdate> updates_;
  std::set<UpdateKey> committed_;
  std::vector<v1::ShardOrder> orders_seen_;
  uint64_t update_ids_ = 0;
  uint64_t next_order_ = 0;
};

TEST_F(ShardedLayerGroupsTest, GroupStepsCommitAllOrNothingAndMatchOneProcess) {
  // The layout this test needs: a group spread over both shard processes (its update is
  // complete only with both parts) and the parts an update of each group has.
  std::optional<uint32_t> spread;
  for (uint32_t g = 0; g < kGroups; ++g) {
    const uint32_t owners = Owns(0, g) + Owns(1, g);
    EXPECT_EQ(core_->shard_log()->PartsOf(g), owners) << "group " << g;
    if (owners == 2 && !spread) spread = g;
  }
  ASSERT_TRUE(spread.has_value()) << "no layer group spans both shard processes";
  ASSERT_LT(core_->shard_log()->PartsOf((*spread + 1) % kGroups) +
                core_->shard_log()->PartsOf((*spread + 2) % kGroups),
            4u)
      << "no layer group lies on one shard process only";

  const uint64_t a = Join();
  const uint64_t b = Join();
  // Three tasks per trainer, their group pushes interleaved.
  for (int round = 0; round < 3; ++round) {
    const v1::Task ta = Request(a);
    const v1::Task tb = Request(b);
    ASSERT_EQ(ta.kind(), v1::Task::TRAIN);
    ASSERT_EQ(tb.kind(), v1::Task::TRAIN);
    for (uint32_t g = 0; g < kGroups; ++g) {
      // Both take the group, so that the second push is one step stale.
      const bool more = g + 1 < kGroups;
      const uint64_t base_a = Take(a, g);
      const uint64_t base_b = Take(b, g);
      ASSERT_THAT(PushTaken(a, ta, g, base_a, more), IsOk());
      ASSERT_THAT(PushTaken(b, tb, g, base_b, more), IsOk());
    }
    if (round != 1) continue;
    // A third worker dies mid-push of the spread group: one shard process staged its part.
    const uint64_t c = Join();
    const v1::Task tc = Request(c);
    const uint64_t before = core_->version();
    absl::StatusOr<v1::PushReply> cut = PushGroup(c, tc, *spread, true, /*cut_after=*/0u);
    ASSERT_THAT(cut, IsOk());
    EXPECT_TRUE(cut->staged()) << "half an update is not pushed";
    EXPECT_EQ(core_->version(), before);
    EXPECT_EQ(shards_[0]->staged_count(), 1u);
    v1::LeaveRequest leave;
    leave.set_worker_id(c);
    ASSERT_THAT(core_->Leave(leave), IsOk());
    Follow();
    EXPECT_EQ(shards_[0]->staged_count(), 0u) << "the coordinator's DISCARD dropped the part";
    const UpdateKey victim(c, update_ids_);
    bool discarded = false;
    for (const v1::ShardOrder& o : orders_seen_) {
      discarded |= o.kind() == v1::ShardOrder::DISCARD && o.entries(0).worker_id() == c &&
                   o.entries(0).update_id() == victim.second;
    }
    EXPECT_TRUE(discarded);
    EXPECT_EQ(committed_.count(victim), 0u);
  }

  // Every push was its own step: 2 trainers x 3 tasks x 3 groups.
  EXPECT_EQ(core_->version(), 18u);
  EXPECT_EQ(committed_.size(), 18u);
  EXPECT_EQ(replay_->version(), 18u);
  const ModelSnapshot expected = replay_->Snapshot();
  size_t stale = 0;
  for (const v1::ShardOrder& o : orders_seen_) {
    for (const v1::CommitEntry& e : o.entries())
      stale += o.kind() == v1::ShardOrder::COMMIT && e.discount() < 1.0f;
  }
  EXPECT_GT(stale, 0u) << "interleaved groups carry the staleness discount";
  for (uint32_t g = 0; g < kGroups; ++g) {
    EXPECT_EQ(core_->group_version(g), 6u) << "group " << g;
    EXPECT_EQ(replay_->group_version(g), 6u);
  }
  for (uint32_t s = 0; s < 2; ++s) {
    const ShardState& shard = *shards_[s];
    EXPECT_EQ(shard.version(), 18u);
    for (uint32_t g = 0; g < kGroups; ++g) EXPECT_EQ(shard.group_version(g), 6u);
    absl::StatusOr<ModelSnapshot> now = shard.SnapshotAt(shard.version());
    ASSERT_THAT(now, IsOk());
    for (uint32_t l : shard.owned_layers()) {
      const std::vector<float>& want = *expected.layers[l];
      const std::vector<float>& got = *now->layers[l];
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << "shard " << s << " layer " << l << " element " << i;
      }
    }
  }
}

TEST_F(ShardedLayerGroupsTest, GroupVersionsTravelInEveryCheckpoint) {
  const uint64_t a = Join();
  const v1::Task task = Request(a);
  ASSERT_THAT(PushGroup(a, task, 1, true), IsOk());
  ASSERT_THAT(PushGroup(a, task, 2, true), IsOk());
  ASSERT_THAT(PushGroup(a, task, 1, false), IsOk());
  const std::vector<uint64_t> want = {0, 2, 1};

  // The coordinator's checkpoint restores its group versions into a fresh core.
  const v1::ServerCheckpoint coordinator = core_->CaptureCheckpoint();
  EXPECT_EQ(std::vector<uint64_t>(coordinator.group_versions().begin(),
                                  coordinator.group_versions().end()),
            want);
  auto fresh = ServerCore::Create(config_, {{"a", "a.tok", 1000}, {"b", "b.tok", 3000}},
                                  "heldout.tok", clock_, executor_, metrics_);
  ASSERT_THAT(fresh, IsOk());
  ASSERT_THAT((*fresh)->RestoreCheckpoint(coordinator), IsOk());
  for (uint32_t g = 0; g < kGroups; ++g) EXPECT_EQ((*fresh)->group_version(g), want[g]);
  // Group versions that do not fit are refused, and change nothing.
  v1::ServerCheckpoint bad = coordinator;
  bad.mutable_group_versions()->RemoveLast();
  EXPECT_THAT((*fresh)->RestoreCheckpoint(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer group versions")));
  EXPECT_EQ((*fresh)->group_version(2), 1u);

  // Each shard process's checkpoint holds every group's version, also of groups it has no
  // layer of, and a restored shard counts on from them.
  ShardedCheckpoint sharded{coordinator, {}};
  for (uint32_t s = 0; s < 2; ++s) {
    const v1::ShardCheckpoint c = shards_[s]->Capture("f");
    EXPECT_EQ(std::vector<uint64_t>(c.group_versions().begin(), c.group_versions().end()), want);
    // Foreign entries may be empty; the owned ones' values are replaced by the checkpoint's.
    std::vector<std::vector<float>> sized;
    for (const v1::LayerSpec& layer : core_->spec().layers()) {
      sized.emplace_back(layer.shard() == s ? layer.num_elements() : 0);
    }
    auto restored = ShardState::Create(core_->spec(), s, sized, config_.outer_optimizer(), 1, 8,
                                       executor_, core_->layer_groups());
    ASSERT_THAT(restored, IsOk());
    ASSERT_THAT((*restored)->Restore(c, "f"), IsOk());
    EXPECT_EQ((*restored)->version(), 3u);
    for (uint32_t g = 0; g < kGroups; ++g) EXPECT_EQ((*restored)->group_version(g), want[g]);
    sharded.shards.push_back(c);
  }
  // Moving between layouts keeps them: joined into one process's checkpoint, split again.
  absl::StatusOr<v1::ServerCheckpoint> joined = JoinShardCheckpoints(core_->spec(), sharded);
  ASSERT_THAT(joined, IsOk());
  EXPECT_EQ(std::vector<uint64_t>(joined->group_versions().begin(), joined->group_versions().end()),
            want);
  absl::StatusOr<ShardedCheckpoint> split = SplitCheckpoint(core_->spec(), *joined);
  ASSERT_THAT(split, IsOk());
  for (const v1::ShardCheckpoint& c : split->shards) {
    EXPECT_EQ(std::vector<uint64_t>(c.group_versions().begin(), c.group_versions().end()), want);
  }
  sharded.shards[1].mutable_group_versions()->Set(0, 7);
  EXPECT_THAT(JoinShardCheckpoints(core_->spec(), sharded),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer group versions")));
}

TEST_F(ShardedLayerGroupsTest, PartsAndCommitsOfTheWrongGroupAreRefused) {
  // A part of a group staged where it owns no layer, and a commit naming another group than
  // its staged update, change nothing.
  std::optional<std::pair<uint32_t, uint32_t>> lone;  // (group, the shard without its layers)
  for (uint32_t g = 0; g < kGroups && !lone; ++g) {
    for (uint32_t s = 0; s < 2; ++s) {
      if (!Owns(s, g)) lone = std::make_pair(g, s);
    }
  }
  ASSERT_TRUE(lone.has_value());
  {
    PendingUpdate part;
    part.worker_id = 1;
    part.update_id = 1;
    part.group = lone->first;
    part.layers.resize(core_->spec().layers_size());
    EXPECT_THAT(shards_[lone->second]->Stage(part),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("owns no layer")));
    v1::PushHeader header;
    header.set_worker_id(1);
    header.set_group(lone->first);
    EXPECT_THAT(core_->shard_log()->StagePart(lone->second, header),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("owns no layer")));
  }
  // Group 0's layers on shard 0, with data in a layer of another group.
  PendingUpdate part;
  part.worker_id = 1;
  part.update_id = 2;
  part.group = 0;
  uint32_t other_layer = 0;
  for (const v1::LayerSpec& layer : core_->spec().layers()) {
    const bool mine = layer.shard() == 0;
    const uint32_t g = core_->layer_groups()[layer.id()];
    part.layers.emplace_back(mine && g == 0 ? layer.num_elements() : 0, 0.5f);
    if (mine && g != 0) other_layer = layer.id();
  }
  ASSERT_TRUE(Owns(0, 0));
  PendingUpdate wrong = part;
  wrong.layers[other_layer].assign(core_->spec().layers(other_layer).num_elements(), 1.0f);
  EXPECT_THAT(shards_[0]->Stage(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not in group 0")));
  ASSERT_THAT(shards_[0]->Stage(part), IsOk());
  v1::ShardOrder commit;
  commit.set_kind(v1::ShardOrder::COMMIT);
  commit.set_version(1);
  commit.set_by_group(true);
  commit.set_layer_group(1);
  v1::CommitEntry* entry = commit.add_entries();
  entry->set_worker_id(1);
  entry->set_update_id(2);
  entry->set_weight(1);
  ASSERT_TRUE(Owns(0, 1));
  EXPECT_THAT(shards_[0]->Apply(commit),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is of group 0")));
  commit.set_by_group(false);
  EXPECT_THAT(shards_[0]->Apply(commit),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names no layer group")));
  EXPECT_EQ(shards_[0]->version(), 0u);
  EXPECT_TRUE(shards_[0]->IsStaged(1, 2));
  commit.set_by_group(true);
  commit.set_layer_group(0);
  ASSERT_THAT(shards_[0]->Apply(commit), IsOk());
  EXPECT_EQ(shards_[0]->group_version(0), 1u);
  EXPECT_EQ(shards_[0]->group_version(1), 0u);
}

}  // namespace
}  // namespace aloe::server
