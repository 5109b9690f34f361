#include "server/core/order_journal.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string FreshFile(const std::string& name) {
  const std::string path =
      ::testing::TempDir() + "/journal_" + name + "_" + std::to_string(getpid());
  std::remove(path.c_str());
  return path;
}

v1::ShardOrder Commit(uint64_t version, uint64_t worker, float weight) {
  v1::ShardOrder order;
  order.set_kind(v1::ShardOrder::COMMIT);
  order.set_version(version);
  v1::CommitEntry* entry = order.add_entries();
  entry->set_worker_id(worker);
  entry->set_update_id(version);
  entry->set_weight(weight);
  return order;
}

v1::ShardOrder Discard(uint64_t worker) {
  v1::ShardOrder order;
  order.set_kind(v1::ShardOrder::DISCARD);
  order.add_entries()->set_worker_id(worker);
  return order;
}

v1::ShardOrder Restore(uint64_t version) {
  v1::ShardOrder order;
  order.set_kind(v1::ShardOrder::RESTORE);
  order.set_version(version);
  return order;
}

// (version, worker of the first entry) of each order.
std::vector<std::pair<uint64_t, uint64_t>> Versions(const std::vector<v1::ShardOrder>& orders) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const v1::ShardOrder& o : orders) {
    out.emplace_back(o.version(), o.entries_size() ? o.entries(0).worker_id() : 0);
  }
  return out;
}

TEST(OrderJournalTest, WritesEachOrderOnceAndARestorePerAssembly) {
  const std::string path = FreshFile("write");
  {
    absl::StatusOr<std::unique_ptr<OrderJournal>> journal = OrderJournal::Open(path);
    ASSERT_THAT(journal.status(), IsOk());
    (*journal)->Assembled(0);
    std::vector<v1::ShardOrder> log = {Commit(1, 7, 0.5f)};
    (*journal)->CatchUp(log);
    (*journal)->CatchUp(log);  // nothing new
    log.push_back(Discard(9));
    log.push_back(Commit(2, 8, 0.25f));
    (*journal)->CatchUp(log);
    // The front of the log was trimmed (absolute indices stay): nothing is written twice.
    (*journal)->CatchUp({log[2]}, 2);
    // A reassembly at version 1: the next log starts empty.
    (*journal)->Assembled(1);
    (*journal)->CatchUp({Commit(2, 3, 1.0f)});
    EXPECT_THAT((*journal)->status(), IsOk());
  }
  absl::StatusOr<std::vector<v1::ShardOrder>> read = ReadOrderJournal(path);
  ASSERT_THAT(read.status(), IsOk());
  ASSERT_EQ(read->size(), 6u);
  EXPECT_EQ((*read)[0].kind(), v1::ShardOrder::RESTORE);
  EXPECT_EQ((*read)[2].kind(), v1::ShardOrder::DISCARD);
  EXPECT_EQ((*read)[3].entries(0).weight(), 0.25f);
  EXPECT_EQ((*read)[4].kind(), v1::ShardOrder::RESTORE);
  EXPECT_EQ((*read)[4].version(), 1u);

  // Reopening appends.
  {
    absl::StatusOr<std::unique_ptr<OrderJournal>> journal = OrderJournal::Open(path);
    ASSERT_THAT(journal.status(), IsOk());
    (*journal)->Assembled(2);
  }
  read = ReadOrderJournal(path);
  ASSERT_THAT(read.status(), IsOk());
  EXPECT_EQ(read->size(), 7u);

  // Version 2 of worker 8 was undone by the reassembly at 1; worker 3's version 2 stands.
  absl::StatusOr<std::vector<v1::ShardOrder>> history = CommittedHistory(*read);
  ASSERT_THAT(history.status(), IsOk());
  EXPECT_THAT(Versions(*history), ElementsAre(std::pair<uint64_t, uint64_t>{1, 7},
                                              std::pair<uint64_t, uint64_t>{2, 3}));
}

TEST(OrderJournalTest, CommittedHistoryRulesAndGaps) {
  // Restores undo the commits above their version; a restore below the first base restarts.
  absl::StatusOr<std::vector<v1::ShardOrder>> history =
      CommittedHistory({Restore(4), Commit(5, 1, 1), Commit(6, 1, 1), Commit(7, 1, 1), Restore(5),
                        Commit(6, 2, 1), Restore(6), Commit(7, 3, 1)});
  ASSERT_THAT(history.status(), IsOk());
  EXPECT_THAT(Versions(*history),
              ElementsAre(std::pair<uint64_t, uint64_t>{5, 1}, std::pair<uint64_t, uint64_t>{6, 2},
                          std::pair<uint64_t, uint64_t>{7, 3}));
  history = CommittedHistory({Restore(4), Commit(5, 1, 1), Restore(2), Commit(3, 2, 1)});
  ASSERT_THAT(history.status(), IsOk());
  EXPECT_THAT(Versions(*history), ElementsAre(std::pair<uint64_t, uint64_t>{3, 2}));

  EXPECT_THAT(CommittedHistory({Commit(1, 1, 1)}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a RESTORE first")));
  EXPECT_THAT(CommittedHistory({Restore(0), Commit(1, 1, 1), Commit(3, 1, 1)}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("commits version 3, expected 2")));
  EXPECT_THAT(CommittedHistory({Restore(0), Commit(1, 1, 1), Restore(3)}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("restores version 3")));
}

TEST(OrderJournalTest, MissingTruncatedAndUnopenable) {
  EXPECT_THAT(ReadOrderJournal(FreshFile("missing")).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no order journal")));
  EXPECT_THAT(OrderJournal::Open("/nonexistent-dir/journal").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/nonexistent-dir/journal")));

  const std::string path = FreshFile("truncated");
  {
    absl::StatusOr<std::unique_ptr<OrderJournal>> journal = OrderJournal::Open(path);
    ASSERT_THAT(journal.status(), IsOk());
    (*journal)->Assembled(0);
    (*journal)->CatchUp({Commit(1, 7, 0.5f)});
  }
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 3);
  EXPECT_THAT(ReadOrderJournal(path).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("entry 1 is truncated")));
}

}  // namespace
}  // namespace aloe::server
