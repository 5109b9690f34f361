#include "server/core/commit_replay.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/executor.h"
#include "common/status_matchers.h"
#include "server/core/commit_record.h"
#include "server/core/shard_state.h"
#include "tests/testing/shard_orders.h"

namespace aloe::server {
namespace {

using ::aloe::testing::CommitOrder;
using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string FreshFile(const std::string& name) {
  const std::string path =
      ::testing::TempDir() + "/commit_record_" + name + "_" + std::to_string(getpid());
  std::remove(path.c_str());
  return path;
}

// Three layers over two shard processes: 0 (3 values) and 2 (2) on shard 0, 1 (4) on shard 1.
v1::ModelSpec Spec() {
  v1::ModelSpec spec;
  spec.set_num_shards(2);
  const uint64_t sizes[] = {3, 4, 2};
  for (uint32_t i = 0; i < 3; ++i) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_id(i);
    layer->set_name("layer" + std::to_string(i));
    layer->set_num_elements(sizes[i]);
    layer->set_shard(i == 1 ? 1 : 0);
  }
  return spec;
}

std::vector<std::vector<float>> Initial() { return {{1, 2, 3}, {10, 20, 30, 40}, {5, 6}}; }

v1::OuterOptimizerConfig DelayedNesterov() {
  v1::OuterOptimizerConfig c;
  c.set_type(v1::OUTER_DELAYED_NESTEROV);
  c.set_lr(0.7f);
  c.set_momentum(0.9f);
  c.set_dn_buffer_size(2);
  return c;
}

// Update (worker, update)'s values: distinct per update and layer, not round numbers.
std::vector<float> Values(uint64_t worker, uint64_t update, uint32_t layer, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = 0.013f * static_cast<float>(worker) - 0.0071f * static_cast<float>(update) +
           0.0029f * static_cast<float>(layer * 7 + i);
  }
  return v;
}

// Two shard processes that record their commits, driven as the coordinator would.
class TwoShards {
 public:
  explicit TwoShards(const std::string& record) {
    auto recorder = CommitRecorder::Open(record);
    EXPECT_THAT(recorder.status(), IsOk());
    recorder_ = *std::move(recorder);
    for (uint32_t s = 0; s < 2; ++s) {
      auto state = ShardState::Create(Spec(), s, Initial(), DelayedNesterov(), 1, 8, executor_);
      EXPECT_THAT(state.status(), IsOk());
      (*state)->SetCommitObserver([this](const std::vector<uint32_t>& owned,
                                         const std::vector<const PendingUpdate*>& updates) {
        recorder_->Record(owned, updates);
      });
      shards_.push_back(*std::move(state));
    }
  }

  void Stage(uint64_t worker, uint64_t update) {
    for (uint32_t s = 0; s < 2; ++s) {
      PendingUpdate part;
      part.worker_id = worker;
      part.update_id = update;
      part.task_id = update;
      part.layers.resize(3);
      for (uint32_t l = 0; l < 3; ++l) {
        if ((l == 1 ? 1u : 0u) == s)
          part.layers[l] = Values(worker, update, l, Spec().layers(l).num_elements());
      }
      ASSERT_THAT(shards_[s]->Stage(std::move(part)).status(), IsOk());
    }
  }

  void Apply(const v1::ShardOrder& order) {
    journal.push_back(order);
    for (auto& shard : shards_) ASSERT_THAT(shard->Apply(order), IsOk());
  }

  std::vector<v1::ShardCheckpoint> Capture() {
    std::vector<v1::ShardCheckpoint> out;
    for (auto& shard : shards_) out.push_back(shard->Capture("f"));
    return out;
  }

  void Restore(const std::vector<v1::ShardCheckpoint>& checkpoints) {
    v1::ShardOrder restore;
    restore.set_kind(v1::ShardOrder::RESTORE);
    restore.set_version(checkpoints[0].version());
    journal.push_back(restore);
    for (uint32_t s = 0; s < 2; ++s) ASSERT_THAT(shards_[s]->Restore(checkpoints[s], "f"), IsOk());
  }

  // The final parameters and versions of both processes.
  void Final(ReplayInputs* in) {
    for (auto& shard : shards_) {
      absl::StatusOr<ModelSnapshot> now = shard->SnapshotAt(shard->version());
      ASSERT_THAT(now.status(), IsOk());
      for (uint32_t l : shard->owned_layers()) in->final_params[l] = *now->layers[l];
      in->final_versions.push_back(shard->version());
    }
  }

  std::vector<v1::ShardOrder> journal;

 private:
  InlineExecutor executor_;
  std::unique_ptr<CommitRecorder> recorder_;
  std::vector<std::unique_ptr<ShardState>> shards_;
};

// Commits 1-3, a checkpoint at 2, commit 3 undone by a RESTORE of 2, then 3 and 4 again with
// other updates: the journal, the records and the processes' final state.
ReplayInputs RunWithRestore(const std::string& record) {
  ReplayInputs in;
  TwoShards shards(record);
  v1::ShardOrder start;
  start.set_kind(v1::ShardOrder::RESTORE);
  start.set_version(0);
  shards.journal.push_back(start);
  shards.Stage(1, 1);
  shards.Apply(CommitOrder(1, {{1, 1, 1.0f}}));
  shards.Stage(2, 1);
  shards.Stage(1, 2);
  shards.Apply(CommitOrder(2, {{2, 1, 0.6f}, {1, 2, 0.4f}}));
  const std::vector<v1::ShardCheckpoint> at2 = shards.Capture();
  shards.Stage(3, 1);
  shards.Apply(CommitOrder(3, {{3, 1, 1.0f}}));  // undone below
  shards.Restore(at2);
  shards.Stage(2, 2);
  shards.Apply(CommitOrder(3, {{2, 2, 0.5f}}));
  shards.Stage(3, 2);
  shards.Stage(1, 3);
  shards.Apply(CommitOrder(4, {{3, 2, 0.75f}, {1, 3, 0.25f}}));
  shards.Final(&in);
  in.journal = shards.journal;
  in.spec = Spec();
  in.initial = Initial();
  in.optimizer = DelayedNesterov();
  return in;
}

TEST(CommitRecordTest, ReadsBackEveryRecordAndDropsACutLastOne) {
  const std::string path = FreshFile("roundtrip");
  {
    auto recorder = CommitRecorder::Open(path);
    ASSERT_THAT(recorder.status(), IsOk());
    PendingUpdate a, b;
    a.worker_id = 4;
    a.update_id = 9;
    a.layers = {{1.5f, -2.0f}, {3.25f}};
    b.worker_id = 5;
    b.update_id = 1;
    b.layers = {{0.0f, 7.0f}, {}};
    (*recorder)->Record({2, 0}, {&a, &b});
    EXPECT_THAT((*recorder)->status(), IsOk());
  }
  bool cut = true;
  absl::StatusOr<std::vector<RecordedUpdate>> read = ReadCommitRecords(path, &cut);
  ASSERT_THAT(read.status(), IsOk());
  EXPECT_FALSE(cut);
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0].worker_id, 4u);
  EXPECT_EQ((*read)[0].update_id, 9u);
  EXPECT_THAT((*read)[0].layers.at(2), ElementsAre(1.5f, -2.0f));
  EXPECT_THAT((*read)[0].layers.at(0), ElementsAre(3.25f));
  EXPECT_THAT((*read)[1].layers.at(0), ElementsAre());

  // A process killed mid-record: the whole ones stay.
  const std::string whole = [&] {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  std::ofstream(path, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() - 3);
  read = ReadCommitRecords(path, &cut);
  ASSERT_THAT(read.status(), IsOk());
  EXPECT_TRUE(cut);
  EXPECT_EQ(read->size(), 1u);

  std::ofstream(path, std::ios::binary | std::ios::trunc) << "not a record file at all";
  EXPECT_THAT(ReadCommitRecords(path).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("byte 0")));
  EXPECT_THAT(ReadCommitRecords(path + ".missing").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no commit record")));
}

TEST(CommitReplayTest, ReplayEqualsTwoShardProcessesAcrossARestore) {
  const std::string path = FreshFile("replay");
  ReplayInputs in = RunWithRestore(path);
  absl::StatusOr<std::vector<RecordedUpdate>> records = ReadCommitRecords(path);
  ASSERT_THAT(records.status(), IsOk());
  // 7 updates committed (one of them later undone), each recorded by both processes.
  EXPECT_EQ(records->size(), 14u);
  in.records = *std::move(records);
  absl::StatusOr<ReplayReport> report = ReplayCommits(in);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_EQ(report->version, 4u);
  EXPECT_EQ(report->commits, 4u);
  EXPECT_EQ(report->updates, 6u);  // the undone commit of (3, 1) is not replayed
  EXPECT_EQ(report->parameters, 9u);
  EXPECT_EQ(report->different, 0u) << report->Summary();
  EXPECT_TRUE(report->versions_match);
  EXPECT_GT(report->max_moved, 0.001);
}

TEST(CommitReplayTest, ADifferentWeightOrOrderOrAMissingRecordIsCaught) {
  const std::string path = FreshFile("mismatch");
  ReplayInputs in = RunWithRestore(path);
  absl::StatusOr<std::vector<RecordedUpdate>> records = ReadCommitRecords(path);
  ASSERT_THAT(records.status(), IsOk());
  in.records = *records;

  // The journal claims another weight than the processes applied.
  ReplayInputs weight = in;
  weight.journal.back().mutable_entries(1)->set_weight(0.3f);
  absl::StatusOr<ReplayReport> report = ReplayCommits(weight);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_GT(report->different, 0u);

  // Two commits swapped (the same updates in another order; momentum makes order matter).
  ReplayInputs order = in;
  std::swap(*order.journal[5].mutable_entries(), *order.journal[6].mutable_entries());
  report = ReplayCommits(order);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_GT(report->different, 0u);

  // A process one version behind.
  ReplayInputs behind = in;
  behind.final_versions[1] = 3;
  report = ReplayCommits(behind);
  ASSERT_THAT(report.status(), IsOk());
  EXPECT_FALSE(report->versions_match);

  // Shard 1's record of update (1, 3) lost: its layer 1 cannot be replayed.
  ReplayInputs missing = in;
  missing.records.erase(std::remove_if(missing.records.begin(), missing.records.end(),
                                       [](const RecordedUpdate& r) {
                                         return r.worker_id == 1 && r.update_id == 3 &&
                                                r.layers.count(1) > 0;
                                       }),
                        missing.records.end());
  EXPECT_THAT(ReplayCommits(missing).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("update 3 of worker 1, whose layer 1 was not recorded")));
}

}  // namespace
}  // namespace aloe::server
